"""Packing variable-length sequences without padding, and balancing them over data-parallel ranks.

Legend: T packed tokens.

A packed batch is all sequences back to back (`input_ids_T`) with their lengths; attention masks by
sequence (cu_seqlens-style), so no token attends across a boundary and no compute is spent on padding.

Cost of a sequence of length n on one rank: n * linear + n^2 * quadratic, where the linear term is the
per-token matmul work (about 2 x active parameters) and the quadratic one the causal attention work
(about 2 x heads x head_dim x layers per pair). Ranks are balanced by longest-processing-time greedy
assignment, within 4/3 of the optimum makespan.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import torch

from model.config import ModelConfig

__all__ = ["PackedBatch", "SequenceCost", "assign_to_ranks", "pack_sequences", "split_microbatches"]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Sequences back to back; `targets_T[t]` is the next token of the same sequence (mask 0 at ends)."""

    input_ids_T: torch.Tensor
    seq_lens: tuple[int, ...]
    targets_T: torch.Tensor
    target_mask_T: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on ``device``."""
        return dataclasses.replace(self, input_ids_T=self.input_ids_T.to(device), targets_T=self.targets_T.to(device),
                                   target_mask_T=self.target_mask_T.to(device))

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Start offsets plus the total, shape (num_sequences + 1,), int32."""
        lens = torch.tensor((0, *self.seq_lens), dtype=torch.int32)
        return lens.cumsum(0, dtype=torch.int32)


def pack_sequences(sequences: Sequence[Sequence[int] | torch.Tensor]) -> PackedBatch:
    """Concatenate token sequences (each non-empty) into a `PackedBatch`."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    tensors = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    lens = tuple(int(t.shape[0]) for t in tensors)
    if min(lens) == 0:
        raise ValueError(f"every sequence must be non-empty, got lengths {lens}")
    ids_T = torch.cat(tensors)
    targets = torch.cat([torch.cat([t[1:], t.new_zeros(1)]) for t in tensors])
    mask = torch.cat([torch.cat([torch.ones(n - 1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]) for n in lens])
    return PackedBatch(ids_T, lens, targets, mask)


@dataclasses.dataclass(frozen=True)
class SequenceCost:
    """cost(n) = linear * n + quadratic * n^2 (units: multiply-adds)."""

    linear: float
    quadratic: float

    def __post_init__(self) -> None:
        if self.linear < 0 or self.quadratic < 0:
            raise ValueError(f"SequenceCost terms must be >= 0, got {self.linear}, {self.quadratic}")

    def __call__(self, n: int) -> float:
        return self.linear * n + self.quadratic * n * n

    @classmethod
    def for_model(cls, config: ModelConfig) -> SequenceCost:
        """Per-token matmul work of the active parameters; causal attention halves the n^2 pairs."""
        d, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
        attn = d * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
        experts = 3 * d * config.moe_intermediate_size * config.num_experts_per_tok
        linear = layers * (attn + experts + d * config.num_experts) + d * config.vocab_size
        quadratic = layers * config.num_attention_heads * hd  # 2 matmuls x n^2/2 pairs
        return cls(float(linear), float(quadratic))


def assign_to_ranks(lengths: Sequence[int], num_ranks: int, cost: SequenceCost) -> list[list[int]]:
    """Indices of the sequences each rank gets, balancing total cost (LPT greedy; deterministic)."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be > 0, got {num_ranks}")
    order = sorted(range(len(lengths)), key=lambda i: (-cost(lengths[i]), i))
    heap = [(0.0, r) for r in range(num_ranks)]
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, rank = heapq.heappop(heap)
        out[rank].append(i)
        heapq.heappush(heap, (load + cost(lengths[i]), rank))
    return out


def split_microbatches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy first-fit of sequences (in order) into micro-batches of at most `max_tokens` tokens.

    A sequence longer than `max_tokens` gets a micro-batch of its own.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    batches: list[list[int]] = []
    sizes: list[int] = []
    for i in indices:
        n = lengths[i]
        for b, size in enumerate(sizes):
            if size + n <= max_tokens:
                batches[b].append(i)
                sizes[b] += n
                break
        else:
            batches.append([i])
            sizes.append(n)
    return batches
