"""Slot-based key/value cache for generation, tagged with the weight versions that wrote it.

Legend: S slots, Hkv key/value heads, C capacity (positions), Hd head dim, B sequences in a step.

Each running sequence owns one slot. Storage is one (S, Hkv, C, Hd) tensor per layer for keys and one for
values; capacity grows by doubling up to `max_len`, so a short-prompt workload does not pay for the full
context. Every slot records the set of weight versions whose keys/values it holds: the engine refuses to
attend over entries from another version unless the sequence's swap policy explicitly kept them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.errors import EngineError

__all__ = ["KVCache"]


class KVCache:
    """Keys/values for `num_slots` sequences of up to `max_len` positions, for every layer."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        initial_capacity: int = 256,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.capacity = min(initial_capacity, max_len)
        shape = (num_slots, num_kv_heads, self.capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(num_slots))
        self.slot_versions: dict[int, set[int]] = {}

    # -- slots -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot (keeps active slots dense, so steps can use views)."""
        if not self._free:
            raise EngineError(f"KV cache has no free slot (num_slots={self.num_slots}); raise max_batch_size")
        self._free.sort()
        slot = self._free.pop(0)
        self.slot_versions[slot] = set()
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise EngineError(f"KV slot {slot} released twice")
        self.slot_versions.pop(slot, None)
        self._free.append(slot)

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's contents (its entries will be rewritten from position 0)."""
        self.slot_versions[slot] = set()

    def mark_written(self, slot: int, version: int) -> None:
        self.slot_versions[slot].add(version)

    def versions(self, slot: int) -> frozenset[int]:
        return frozenset(self.slot_versions.get(slot, ()))

    # -- storage -----------------------------------------------------------------------------------
    def ensure_capacity(self, length: int) -> None:
        """Grow every layer's storage (doubling) so that `length` positions fit."""
        if length > self.max_len:
            raise EngineError(f"sequence length {length} exceeds the KV cache max_len={self.max_len}")
        if length <= self.capacity:
            return
        new_cap = self.capacity
        while new_cap < length:
            new_cap *= 2
        new_cap = min(new_cap, self.max_len)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                grown = old.new_zeros((old.shape[0], old.shape[1], new_cap, old.shape[3]))
                grown[:, :, : self.capacity] = old
                store[i] = grown
        self.capacity = new_cap

    def write_span(self, layer: int, slot: int, start: int, k_NHkvHd: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of positions [start, start + N) of one slot."""
        self.write_spans(layer, slot, 1, start, k_NHkvHd, v)

    def write_spans(
        self, layer: int, first_slot: int, num_slots: int, start: int, k_MNHkvHd: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store keys/values of positions [start, start + N) of slots first_slot .. first_slot + M - 1, given
        packed back to back (M * N rows)."""
        m, end = num_slots, start + k_MNHkvHd.shape[0] // num_slots
        for store, new in ((self.k, k_MNHkvHd), (self.v, v)):
            rows_MNHkvHd = new.view(m, -1, *new.shape[1:])
            store[layer][first_slot : first_slot + m, :, start:end] = rows_MNHkvHd.transpose(1, 2)

    def write_tokens(
        self, layer: int, slots_B: torch.Tensor, pos_B: torch.Tensor, k_BHkvHd: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store one position per slot (a decode step)."""
        self.k[layer][slots_B, :, pos_B] = k_BHkvHd
        self.v[layer][slots_B, :, pos_B] = v

    def read(
        self, layer: int, slots: Sequence[int], slots_B: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values (B, Hkv, length, Hd) of the given slots; a view when the slots are contiguous."""
        lo = slots[0]
        if slots[-1] - lo == len(slots) - 1 and list(slots) == list(range(lo, lo + len(slots))):
            return self.k[layer][lo : lo + len(slots), :, :length], self.v[layer][lo : lo + len(slots), :, :length]
        return (
            self.k[layer][:, :, :length].index_select(0, slots_B),
            self.v[layer][:, :, :length].index_select(0, slots_B),
        )
