"""Token-to-expert routing layout shared by every experts implementation.

The K expert choices of T tokens form M = T*K (token, expert) pairs; they are sorted by expert (stable,
so a token's pairs stay in token order inside an expert) and each expert owns the contiguous row
range offsets_E1[e]:offsets_E1[e+1] of the sorted pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_dtype, check_rank
from kernels.errors import ExpertIndexError

__all__ = ["Routing", "route"]


@dataclass(frozen=True)
class Routing:
    """Sorted pair layout.

    token_M: source token of each sorted pair (int64, M).
    pair_M: index of each sorted pair in the flattened (T*K) top-k arrays (int64, M).
    offsets_E1: expert row boundaries in the sorted order (int64, E+1).
    """

    token_M: torch.Tensor
    pair_M: torch.Tensor
    offsets_E1: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.token_M.numel()


def route(topk_ids_TK: torch.Tensor, num_experts: int) -> Routing:
    """Sort (token, expert) pairs by expert.

    Raises:
        ExpertIndexError: an id is outside [0, num_experts).
        KernelShapeError / KernelDTypeError: ids are not a 2-D integer tensor.
    """
    check_rank("topk_ids_TK", topk_ids_TK, 2, "tokens x top-k")
    check_dtype("topk_ids_TK", topk_ids_TK, (torch.int32, torch.int64))
    flat = topk_ids_TK.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ExpertIndexError(
            f"topk_ids_TK must lie in [0, {num_experts}); got min {int(flat.min())}, max {int(flat.max())}"
        )
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    top_k = max(topk_ids_TK.shape[1], 1)
    return Routing(token_M=order // top_k, pair_M=order, offsets_E1=offsets)
