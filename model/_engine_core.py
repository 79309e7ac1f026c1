"""The synchronous heart of the generation engine: scheduling, one forward per step, bookkeeping.

Legend: B sequences in a step, L layers, K experts per token.

Every running sequence keeps `tokens` (prompt + completion) and `num_cached`, the positions whose keys and
values are in its KV slot. A step feeds each running sequence `tokens[num_cached:]` — the whole prompt
when it has just joined, the whole prefix after a RECOMPUTE swap, otherwise the one token sampled last
step — in one packed forward, then samples one token per sequence. Sequences join (prompt prefill) and
leave (stop, length, cancel) between steps.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from model.attention import AttentionBatch
from model.checkpoint import load_state_into
from model.errors import EngineError
from model.generation import EngineConfig, FinishReason, Generation, KVPolicy, WeightSwap
from model.kv_cache import KVCache
from model.sampling import SamplingParams, logprob_temperature, sample_tokens
from model.transformer import MoETransformer

__all__ = ["EngineCore", "Request"]

log = structlog.get_logger(__name__)


@dataclasses.dataclass(eq=False)
class Request:
    """A sequence's mutable state inside the engine."""

    request_id: int
    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    generator: torch.Generator
    max_len: int
    # expert ids of positions [0, num_cached), as views of each step's (rows, L, K) output, in order
    topk_chunks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    swaps: list[WeightSwap] = dataclasses.field(default_factory=list)
    slot: int | None = None
    num_cached: int = 0
    kept_stale_kv: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


class EngineCore:
    """Owns the model, the KV cache and the running set; `step()` advances every running sequence."""

    def __init__(
        self,
        model: MoETransformer,
        config: EngineConfig,
        version: int,
        detokenize: Callable[[Sequence[int]], str] | None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.config = config
        self.version = version
        self.detokenize = detokenize
        self.max_seq_len = min(config.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_slots=config.max_batch_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            max_len=self.max_seq_len,
            dtype=dtype,
            device=next(model.parameters()).device,
            initial_capacity=config.kv_initial_capacity,
        )
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._next_id = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0

    # -- requests ----------------------------------------------------------------------------------
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Validate and build a request (not yet queued)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room: max_seq_len={self.max_seq_len}")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got min {min(prompt)} max {max(prompt)}")
        if params.stop_strings and self.detokenize is None:
            raise ValueError("stop_strings need the engine to be built with a detokenize function")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._seed_gen))
        max_len = min(len(prompt) + params.max_new_tokens, self.max_seq_len)
        self._next_id += 1
        return Request(self._next_id, prompt, len(prompt), params, torch.Generator().manual_seed(seed), max_len)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request_id: int) -> None:
        """Drop a request wherever it is (no-op when it already finished)."""
        self.waiting = collections.deque(r for r in self.waiting if r.request_id != request_id)
        for req in [r for r in self.running if r.request_id == request_id]:
            self._release(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- weights -----------------------------------------------------------------------------------
    def apply_update(self, state: dict[str, torch.Tensor], version: int, policy: KVPolicy) -> None:
        """Copy new weights in and apply `policy` to every running sequence's KV cache."""
        started = time.perf_counter()
        load_state_into(self.model, state)
        old, self.version = self.version, version
        for req in self.running:
            req.swaps.append(WeightSwap(req.num_generated, old, version, policy))
            if policy is KVPolicy.RECOMPUTE:
                assert req.slot is not None
                self.cache.reset_slot(req.slot)
                req.num_cached = 0
            else:
                req.kept_stale_kv = True
        log.info(
            "weights_swapped",
            old_version=old,
            new_version=version,
            kv_policy=policy.value,
            num_running=len(self.running),
            seconds=round(time.perf_counter() - started, 6),
        )

    # -- stepping ----------------------------------------------------------------------------------
    def _admit(self) -> None:
        budget = self.config.max_prefill_tokens
        admitted = 0
        while self.waiting and self.cache.num_free:
            need = len(self.waiting[0].tokens)
            if admitted and need > budget:
                break
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            self.running.append(req)
            budget -= need
            admitted += 1

    def _check_kv(self, req: Request) -> None:
        assert req.slot is not None
        if not req.num_cached or req.kept_stale_kv:
            return
        versions = self.cache.versions(req.slot)
        if versions != {self.version}:
            raise EngineError(
                f"request {req.request_id}: KV slot holds versions {sorted(versions)} but the model is at "
                f"version {self.version} and no KEEP policy was recorded; refusing to attend over stale KV"
            )

    def step(self) -> list[tuple[int, Generation]]:
        """Admit, run one forward over all running sequences, sample; return finished generations."""
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        for req in batch:
            self._check_kv(req)
        feed = [req.tokens[req.num_cached :] for req in batch]
        lens = [len(f) for f in feed]
        self.num_steps += 1
        self.num_generated_tokens += len(batch)
        self.num_prefill_tokens += sum(n for n in lens if n > 1)
        layout = AttentionBatch.cached(
            self.cache,
            [r.slot for r in batch],
            [r.num_cached for r in batch],
            lens,  # type: ignore[misc]
        )
        device = self.cache.k[0].device
        ids_T = torch.tensor([t for f in feed for t in f], device=device)
        # logits of each sequence's last row only (every row already is one when each feeds one token)
        rows = None if len(ids_T) == len(batch) else torch.tensor(list(itertools.accumulate(lens)), device=device) - 1
        with torch.inference_mode():
            out = self.model(ids_T, batch=layout, logits_rows=rows)
        tokens, logprobs = sample_tokens(
            out.logits.float().cpu(), [r.params for r in batch], [r.generator for r in batch]
        )
        topk = out.topk_ids_TLK.to(device="cpu", dtype=torch.int16)
        finished: list[tuple[int, Generation]] = []
        for req, start, n, token, lp in zip(batch, layout.starts, lens, tokens, logprobs, strict=True):
            if req.num_cached == 0:  # (re)computed from position 0: earlier rows are superseded
                req.topk_chunks.clear()
            req.topk_chunks.append(topk[start : start + n])
            assert req.slot is not None
            self.cache.mark_written(req.slot, self.version)
            req.num_cached += n
            req.tokens.append(token)
            req.logprobs.append(lp)
            req.versions.append(self.version)
            reason = self._finish_reason(req, token)
            if reason is not None:
                finished.append((req.request_id, self._finish(req, reason)))
        return finished

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if token in p.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if p.stop_strings and self.detokenize is not None:
            window = 4 * max(len(s) for s in p.stop_strings) + 4
            tail = self.detokenize(req.tokens[max(req.num_prompt, len(req.tokens) - window) :])
            if any(s in tail for s in p.stop_strings):
                return FinishReason.STOP_STRING
        if req.num_generated >= p.max_new_tokens:
            return FinishReason.LENGTH
        if len(req.tokens) >= req.max_len:
            return FinishReason.CONTEXT
        return None

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        if req.slot is not None:
            self.cache.release(req.slot)
            req.slot = None

    def _finish(self, req: Request, reason: FinishReason) -> Generation:
        self._release(req)
        return Generation(
            prompt_ids=tuple(req.tokens[: req.num_prompt]),
            token_ids=tuple(req.tokens[req.num_prompt :]),
            logprobs=tuple(req.logprobs),
            versions=tuple(req.versions),
            topk_ids_TLK=self._topk_rows(req),
            finish_reason=reason,
            swaps=tuple(req.swaps),
            logprob_temperature=logprob_temperature(req.params),
        )

    def _topk_rows(self, req: Request) -> torch.Tensor:
        """(P + N, L, K) expert ids of every position; -1 rows for positions never fed (the last one)."""
        cfg = self.model.config
        rows = torch.full((len(req.tokens), cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, dtype=torch.int16)
        if req.topk_chunks:
            fed = torch.cat(req.topk_chunks)
            rows[: len(fed)] = fed
        return rows

    def run_until_done(self) -> list[tuple[int, Generation]]:
        """Step until nothing is waiting or running (synchronous use: tests, benchmarks, scripts)."""
        done: list[tuple[int, Generation]] = []
        while self.has_work:
            done.extend(self.step())
        return done
