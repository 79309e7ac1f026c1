"""Grouped-query attention over packed variable-length sequences, with or without a KV cache.

Legend: T packed tokens, H query heads, Hkv key/value heads, G = H / Hkv, Hd head dim, D hidden size,
B sequences decoding one token each, L key length.

Sequences are packed back to back without padding; `AttentionBatch` says where each one starts and how
many cached positions precede it. Without a cache (training) every sequence attends causally to itself.
With a cache (generation) new keys/values are written to the sequence's slot first; one-token sequences
are attended in one batched call (queries of a KV group stacked as G rows), longer ones one by one.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layers import RMSNorm, apply_rotary

__all__ = ["Attention", "AttentionBatch"]


@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """Layout of one forward: sequence lengths, cached prefix lengths, positions and the cache."""

    seq_lens: tuple[int, ...]
    past_lens: tuple[int, ...]
    position_ids_T: torch.Tensor
    cache: KVCache | None = None
    slots: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()  # first packed row of each sequence
    # sequences feeding several tokens, in runs attended with one call each (empty without a cache)
    prefill_runs: tuple[PrefillRun, ...] = ()
    # derived for the batched one-token path (empty without a cache)
    decode_seqs: tuple[int, ...] = ()
    decode_slots: tuple[int, ...] = ()
    decode_len: int = 0  # keys attended: the longest decode sequence's prefix + 1
    decode_rows_B: torch.Tensor | None = None
    decode_slots_B: torch.Tensor | None = None
    decode_pos_B: torch.Tensor | None = None
    decode_mask_B11L: torch.Tensor | None = None  # None: every row attends to all decode_len keys

    @property
    def all_decode(self) -> bool:
        """Every sequence feeds one token after a cached prefix: the rows are the decode batch, in order."""
        return len(self.decode_seqs) == len(self.seq_lens)

    @classmethod
    def packed(cls, seq_lens: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> AttentionBatch:
        """Training layout: every sequence starts at position 0, no cache."""
        positions = [torch.arange(n, device=device) for n in seq_lens]
        return cls(
            seq_lens=tuple(int(n) for n in seq_lens),
            past_lens=(0,) * len(seq_lens),
            position_ids_T=torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long, device=device),
            starts=_starts(seq_lens),
        )

    @classmethod
    def cached(cls, cache: KVCache, slots: list[int], past_lens: list[int], seq_lens: list[int]) -> AttentionBatch:
        """Generation layout: sequence i continues slot `slots[i]` after `past_lens[i]` cached positions.

        Built once per step from Python lists; a decode-only step (the common one) makes four small tensors.
        """
        device = cache.k[0].device
        cache.ensure_capacity(max(p + n for p, n in zip(past_lens, seq_lens, strict=True)))
        starts = _starts(seq_lens)
        decode = tuple(i for i, (p, n) in enumerate(zip(past_lens, seq_lens, strict=True)) if n == 1 and p > 0)
        all_decode = len(decode) == len(seq_lens)
        if all_decode:  # one token per sequence, at position past_len
            positions = torch.tensor(past_lens, device=device)
        else:
            spans = zip(past_lens, seq_lens, strict=True)
            positions = torch.cat([torch.arange(p, p + n, device=device) for p, n in spans])
        extra: dict[str, object] = {}
        if decode:
            pasts = [past_lens[i] for i in decode]
            pos_B = positions if all_decode else torch.tensor(pasts, device=device)
            max_len = max(pasts) + 1
            # equal prefixes (the usual batch of equal prompts): no mask, the same numbers, a faster kernel
            ragged = min(pasts) + 1 < max_len
            extra = {
                "decode_slots": tuple(slots[i] for i in decode),
                "decode_len": max_len,
                "decode_rows_B": None if all_decode else torch.tensor([starts[i] for i in decode], device=device),
                "decode_slots_B": torch.tensor([slots[i] for i in decode], device=device),
                "decode_pos_B": pos_B,
                "decode_mask_B11L": (
                    (torch.arange(max_len, device=device) <= pos_B[:, None])[:, None, None, :] if ragged else None
                ),
            }
        return cls(
            seq_lens=tuple(seq_lens),
            past_lens=tuple(past_lens),
            position_ids_T=positions,
            cache=cache,
            slots=tuple(slots),
            starts=starts,
            prefill_runs=_prefill_runs(starts, seq_lens, past_lens, slots, set(decode)),
            decode_seqs=decode,
            **extra,  # type: ignore[arg-type]
        )


@dataclasses.dataclass(frozen=True)
class PrefillRun:
    """`num_seqs` packed sequences of `seq_len` tokens from row `start`, in slots `first_slot`, `first_slot` + 1,
    ..., each after `past` cached positions."""

    start: int
    num_seqs: int
    seq_len: int
    first_slot: int
    past: int


def _prefill_runs(
    starts: tuple[int, ...], seq_lens: list[int], past_lens: list[int], slots: list[int], decode: set[int]
) -> tuple[PrefillRun, ...]:
    """Group the multi-token sequences: fresh ones (no cached prefix) of equal length in consecutive slots
    share a run (one cache write and one attention call per layer); any other is a run of its own."""
    runs: list[PrefillRun] = []
    for i, (start, n, past, slot) in enumerate(zip(starts, seq_lens, past_lens, slots, strict=True)):
        if i in decode:
            continue
        last = runs[-1] if runs else None
        if (
            last is not None
            and past == 0
            and last.past == 0
            and n == last.seq_len
            and start == last.start + last.num_seqs * n
            and slot == last.first_slot + last.num_seqs
        ):
            runs[-1] = dataclasses.replace(last, num_seqs=last.num_seqs + 1)
        else:
            runs.append(PrefillRun(start, 1, n, slot, past))
    return tuple(runs)


def _starts(seq_lens: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(seq_lens, initial=0))[:-1]


def _sdpa_runs(q_THHd: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of each packed sequence with itself; equal-length neighbours share one call."""
    outs: list[torch.Tensor] = []
    i, start = 0, 0
    while i < len(seq_lens):
        n, j = seq_lens[i], i
        while j < len(seq_lens) and seq_lens[j] == n:
            j += 1
        m = j - i
        sl = slice(start, start + m * n)
        qb, kb, vb = (t[sl].view(m, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q_THHd, k, v))
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        outs.append(ob.transpose(1, 2).reshape(m * n, q_THHd.shape[1], q_THHd.shape[2]))
        start += m * n
        i = j
    return torch.cat(outs) if len(outs) != 1 else outs[0]


class Attention(nn.Module):
    """Qwen3 / Llama attention: q/k/v projections, per-head RMSNorm on q and k (Qwen3), RoPE, GQA, output."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=bias)
        # Qwen3 normalises each query/key head before RoPE; Llama has no such norm (identity here).
        self.q_norm: nn.Module = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()

    def forward(
        self, x_TD: torch.Tensor, cos_T1Hd: torch.Tensor, sin_T1Hd: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """`cos_T1Hd`, `sin_T1Hd`: the rotary tables of `RotaryEmbedding.forward` (sin sign-folded)."""
        t = x_TD.shape[0]
        q = apply_rotary(self.q_norm(self.q_proj(x_TD).view(t, self.num_heads, self.head_dim)), cos_T1Hd, sin_T1Hd)
        k = apply_rotary(self.k_norm(self.k_proj(x_TD).view(t, self.num_kv_heads, self.head_dim)), cos_T1Hd, sin_T1Hd)
        v = self.v_proj(x_TD).view(t, self.num_kv_heads, self.head_dim)
        if batch.cache is None:
            o = _sdpa_runs(q, k, v, batch.seq_lens)
        else:
            o = self._cached(q, k, v, batch)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        if batch.all_decode:  # the rows are the decode batch: no gathering or scattering of rows
            return self._decode(q, k, v, batch)
        cache, layer = batch.cache, self.layer_idx
        assert cache is not None
        o = torch.empty_like(q)
        for run in batch.prefill_runs:
            m, n, past = run.num_seqs, run.seq_len, run.past
            sl = slice(run.start, run.start + m * n)
            cache.write_spans(layer, run.first_slot, m, past, k[sl], v[sl])
            if past == 0:
                o[sl] = _sdpa_runs(q[sl], k[sl], v[sl], (n,) * m)
                continue
            slot = run.first_slot
            keys, vals = cache.read(layer, [slot], torch.tensor([slot], device=q.device), past + n)
            positions = torch.arange(past + n, device=q.device)
            mask = positions[None, :] <= positions[past:, None]
            out = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None], keys, vals, attn_mask=mask, enable_gqa=True
            )
            o[sl] = out[0].transpose(0, 1)
        if batch.decode_seqs:
            rows = batch.decode_rows_B
            assert rows is not None
            o[rows] = self._decode(q[rows], k[rows], v[rows], batch)
        return o

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """One new token per decode sequence (q, k, v hold just those rows): write its key/value, attend."""
        cache, layer = batch.cache, self.layer_idx
        assert cache is not None and batch.decode_slots_B is not None and batch.decode_pos_B is not None
        cache.write_tokens(layer, batch.decode_slots_B, batch.decode_pos_B, k, v)
        keys, vals = cache.read(layer, batch.decode_slots, batch.decode_slots_B, batch.decode_len)
        b, groups = q.shape[0], self.num_heads // self.num_kv_heads
        q_BHkvGHd = q.view(b, self.num_kv_heads, groups, self.head_dim)
        out = F.scaled_dot_product_attention(q_BHkvGHd, keys, vals, attn_mask=batch.decode_mask_B11L)
        return out.reshape(b, self.num_heads, self.head_dim)
