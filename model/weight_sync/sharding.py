"""Sharding a state dict across publishing ranks, and assembling the parts a reader fetched.

Each rank publishes a disjoint set of whole tensors. When every rank holds the full state (data
parallel replicas), ``rank_part`` gives each rank its share so encoding and upload are split
between them; ranks that own disjoint tensors already (pipeline or expert parallel) publish what
they own. ``assemble`` merges the parts of one version and refuses overlapping names.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import TypeVar

from model.weight_sync.errors import CorruptVersion

__all__ = ["assemble", "partition", "rank_part"]

V = TypeVar("V")


def partition(num_bytes: Mapping[str, int], world_size: int) -> tuple[frozenset[str], ...]:
    """Split names into ``world_size`` sets of about equal bytes; the same input gives the same split.

    Largest tensor first (ties by name) goes to the rank with the fewest bytes so far (ties by rank).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    loads = [(0, rank) for rank in range(world_size)]
    parts: list[set[str]] = [set() for _ in range(world_size)]
    for name in sorted(num_bytes, key=lambda n: (-num_bytes[n], n)):
        load, rank = heapq.heappop(loads)
        parts[rank].add(name)
        heapq.heappush(loads, (load + num_bytes[name], rank))
    return tuple(frozenset(part) for part in parts)


def rank_part(state: Mapping[str, V], rank: int, world_size: int) -> dict[str, V]:
    """The tensors of ``state`` that ``rank`` of ``world_size`` publishes (see :func:`partition`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    sizes = {name: int(t.nbytes) if hasattr(t, "nbytes") else 0 for name, t in state.items()}
    mine = partition(sizes, world_size)[rank]
    return {name: t for name, t in state.items() if name in mine}


def assemble(parts: Sequence[Mapping[str, V]], *, version: int) -> dict[str, V]:
    """Merge the ranks' parts of ``version``; raises CorruptVersion if two ranks name one tensor."""
    merged: dict[str, V] = {}
    for rank, part in enumerate(parts):
        twice = sorted(set(part) & set(merged))
        if twice:
            raise CorruptVersion(f"version {version}: rank {rank} publishes tensors another rank has: {twice[:5]}")
        merged.update(part)
    return merged
