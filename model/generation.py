"""Value types of the generation engine: its configuration, swap policy, and finished generations.

Legend: P prompt tokens, N completion tokens, L layers, K experts per token.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import torch

from model.errors import ConfigError

__all__ = ["EngineConfig", "FinishReason", "Generation", "KVPolicy", "WeightSwap"]


class KVPolicy(enum.StrEnum):
    """What happens to a running sequence's KV cache when the weights change under it.

    KEEP: continue on keys/values computed by the old weights (cheap; the next tokens mix policies).
    RECOMPUTE: recompute the whole prefix under the new weights before the next token.
    """

    KEEP = "keep"
    RECOMPUTE = "recompute"


class FinishReason(enum.StrEnum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT = "context"  # the engine's max_seq_len reached


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Capacity and defaults of a `GenerationEngine`.

    Args:
        max_batch_size: sequences decoded together (KV cache slots).
        max_prefill_tokens: prompt/recompute tokens admitted per step (at least one sequence always is).
        max_seq_len: prompt + completion limit; None uses the model's max_position_embeddings.
        kv_initial_capacity: positions allocated per slot up front (grows by doubling).
        seed: seeds the generator that picks seeds for requests without one.
        intra_op_threads: intra-op (OpenMP/MKL) threads of the thread that runs the steps; None keeps the
            process's count; "auto" (the default) picks by the model's size (`model.step_thread.auto_threads`):
            one for a small policy, whose decode step is many small matmuls, each of which a second OpenMP
            team beside the event loop thread's would make pay a cross-core wake; the process's count for a
            large one, whose decode step streams its weights from memory and goes twice as fast on two
            cores (model.step_thread has the measurements).
    """

    max_batch_size: int = 32
    max_prefill_tokens: int = 4096
    max_seq_len: int | None = None
    kv_initial_capacity: int = 256
    seed: int = 0
    intra_op_threads: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_prefill_tokens", "kv_initial_capacity"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        threads = self.intra_op_threads
        if threads != "auto" and threads is not None and (not isinstance(threads, int) or threads <= 0):
            raise ConfigError(f"EngineConfig.intra_op_threads must be > 0, None or 'auto', got {threads!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"EngineConfig.max_seq_len must be >= 2, got {self.max_seq_len}")


@dataclasses.dataclass(frozen=True)
class WeightSwap:
    """A weight update a sequence lived through: after `num_generated` completion tokens."""

    num_generated: int
    old_version: int
    new_version: int
    policy: KVPolicy


@dataclasses.dataclass(frozen=True)
class Generation:
    """A finished request.

    Attributes:
        prompt_ids: the prompt (P,).
        token_ids: completion tokens (N,), including a stop token when one ended it.
        logprobs: behaviour log-prob of each completion token: under the tempered distribution it was sampled
            from, before top-p truncation (model.sampling states the rule).
        versions: weight version that produced each completion token.
        topk_ids_TLK: experts of every position of prompt + completion, (P + N, L, K) int16; rows record the
            latest computation of that position (a RECOMPUTE swap overwrites), the final position is never
            fed to the model and holds -1.
        finish_reason: why generation stopped.
        swaps: weight updates during this generation and the KV policy applied for each.
        logprob_temperature: the temperature T of softmax(logits / T) that `logprobs` are taken under (the
            sampling temperature; 1 for greedy decoding): the trainer scores the tokens at the same T.
    """

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    topk_ids_TLK: torch.Tensor
    finish_reason: FinishReason
    swaps: tuple[WeightSwap, ...] = ()
    logprob_temperature: float = 1.0

    @property
    def min_version(self) -> int:
        return min(self.versions)

    @property
    def max_version(self) -> int:
        return max(self.versions)
