"""Token-to-expert routing layout shared by every experts implementation.

The K expert choices of T tokens form M = T*K (token, expert) pairs; they are sorted by expert (stable,
so a token's pairs stay in token order inside an expert) and each expert owns the contiguous row
range offsets_E1[e]:offsets_E1[e+1] of the sorted pairs.

Combining the pairs' results back into tokens (`combine_rows`) is a sum of K rows per token. With
``torch.use_deterministic_algorithms(True)`` it is a sorted segment sum: each token's K rows gathered
in the sorted order and added left to right, so results are bit-identical run to run on any device
(CUDA's ``index_add_`` adds with float atomics in whatever order threads arrive: different bits from run
to run for K >= 3). On the CPU that order is exactly ``index_add_``'s, so both give the same bits;
otherwise ``index_add_`` is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from low_precision._checks import check_dtype, check_rank
from low_precision.errors import ExpertIndexError

__all__ = ["Routing", "combine_rows", "route"]


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


def combine_rows(routing: Routing, rows_MD: torch.Tensor, num_tokens: int,
                 deterministic: bool | None = None) -> torch.Tensor:
    """out[t] = sum of the rows of token t's pairs, (num_tokens, D) in the dtype of ``rows_MD``.

    ``deterministic`` defaults to ``torch.are_deterministic_algorithms_enabled()``: then a sorted segment
    sum (module docstring), else ``index_add_``.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    out_shape = (num_tokens, *rows_MD.shape[1:])
    if not deterministic or routing.num_rows == 0:
        return rows_MD.new_zeros(out_shape).index_add_(0, routing.token_M, rows_MD)
    top_k = routing.num_rows // num_tokens
    # each token's pairs, in the sorted (expert) order index_add_ visits them; argsort(stable) is deterministic
    by_token = torch.argsort(routing.token_M, stable=True)
    grouped = rows_MD.index_select(0, by_token).view(num_tokens, top_k, *rows_MD.shape[1:])
    # left to right from 0, as index_add_ on the CPU adds (half types in float32, rounded once, as it does)
    acc_dtype = torch.float32 if rows_MD.dtype in (torch.bfloat16, torch.float16) else rows_MD.dtype
    out = rows_MD.new_zeros(out_shape, dtype=acc_dtype)
    for k in range(top_k):
        out = out + grouped[:, k].to(acc_dtype)
    return out.to(rows_MD.dtype)


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
