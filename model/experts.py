"""The expert computation of a MoE layer, behind one swappable function.

Legend: T tokens, K experts per token, E experts, D hidden size, F expert intermediate size.

Every MoE block calls its experts through an `ExpertsFn`:

    experts_forward(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF) -> y_TD

    y[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]

`reference_experts_forward` is the plain torch definition (the numerics every low-precision variant in
`kernels/` is measured against). It groups tokens by expert with a stable sort, so one token's result does
not depend on which other tokens share the batch.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["ExpertsFn", "reference_experts_forward", "sort_by_expert"]

_FUSE_ROWS_PER_EXPERT = 32


class ExpertsFn(Protocol):
    """Signature of every expert implementation (reference, emulated low precision, Triton)."""

    def __call__(
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        w_gate_EFD: torch.Tensor,
        w_up_EFD: torch.Tensor,
        w_down_EDF: torch.Tensor,
    ) -> torch.Tensor: ...


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Order the T*K (token, slot) pairs by expert.

    Returns:
        order_S: indices into the flattened (T*K) pairs, grouped by expert, stable within an expert.
        token_S: the token index of each sorted pair (order_S // K).
        counts: number of pairs per expert (length E), as Python ints.
    """
    flat_S = topk_ids_TK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)
    token_S = order_S // topk_ids_TK.shape[1]
    counts = torch.bincount(flat_S, minlength=num_experts).tolist()
    return order_S, token_S, counts


def reference_experts_forward(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """Plain torch SwiGLU experts; differentiable in x, the weights and the gates."""
    num_experts = w_gate_EFD.shape[0]
    order_S, token_S, counts = sort_by_expert(topk_ids_TK, num_experts)
    x_SD = x_TD.index_select(0, token_S)
    f = w_gate_EFD.shape[1]
    # Unbind once: indexing w[e] per expert would make backward build E full-size gradient buffers.
    # With enough rows per expert, one (2F, D) matmul for gate and up beats two (F, D) ones, even after
    # paying for the concatenated copy of the weights.
    fuse = len(token_S) >= _FUSE_ROWS_PER_EXPERT * num_experts
    if fuse:
        w_gu = torch.cat([w_gate_EFD, w_up_EFD], dim=1).unbind(0)
    else:
        w_gate, w_up = w_gate_EFD.unbind(0), w_up_EFD.unbind(0)
    w_down = w_down_EDF.unbind(0)
    outs: list[torch.Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xs_ND = x_SD[start : start + n]
        if fuse:
            gu_N2F = F.linear(xs_ND, w_gu[e])
            h_NF = F.silu(gu_N2F[:, :f]) * gu_N2F[:, f:]
        else:
            h_NF = F.silu(F.linear(xs_ND, w_gate[e])) * F.linear(xs_ND, w_up[e])
        outs.append(F.linear(h_NF, w_down[e]))
        start += n
    if not outs:
        return torch.zeros_like(x_TD)
    y_SD = torch.cat(outs) * topk_weights_TK.reshape(-1)[order_S].unsqueeze(1).to(x_TD.dtype)
    return torch.zeros_like(x_TD).index_add_(0, token_S, y_SD)
