"""The expert computation of a MoE layer, behind one swappable function.

Legend: T tokens, K experts per token, E experts, D hidden size, F expert intermediate size.

Every MoE block calls its experts through an `ExpertsFn`:

    experts_forward(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF) -> y_TD

    y[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]

`reference_experts_forward` is the plain torch definition (the numerics every low-precision variant in
`low_precision/` is measured against). It groups tokens by expert with a stable sort, so one token's result does
not depend on which other tokens share the batch. On CPU it runs each projection of all experts as one
`grouped_mm` call, which does the same per-expert matmuls as a loop over experts, bit for bit, minus ~3
Python-level calls per expert per layer (the bulk of a decode step's overhead); with autograd through
`_GroupedSwiGLU`, whose backward is grouped matmuls too (torch's CPU `grouped_mm` has no backward of its
own for these layouts), instead of a per-expert graph with its weight concatenations, unbinds and stacks.
Elsewhere (CUDA, whose grouped kernels round differently from per-expert matmuls) and in float64 (no CPU
`grouped_mm` kernel) the per-expert loop runs.
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
    """Order the S = T*K (token, slot) pairs by expert.

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


class _PermuteRows(torch.autograd.Function):
    """rows = x[perm] for a permutation; the gradient is a gather by the inverse (no scatter-add)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


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
    num_tokens, top_k = topk_ids_TK.shape
    if _grouped_mm_applies(x_TD, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
        return _grouped_experts(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    order_S, _, counts = sort_by_expert(topk_ids_TK, num_experts)
    inverse_S = torch.empty_like(order_S)
    inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    # dispatch: row s of x_SD is token order_S[s] // K (expand to T*K rows, then permute; no scatter)
    x_TKD = x_TD.unsqueeze(1).expand(num_tokens, top_k, x_TD.shape[1]).reshape(num_tokens * top_k, -1)
    x_SD = _PermuteRows.apply(x_TKD, order_S, inverse_S)
    f = w_gate_EFD.shape[1]
    # Unbind once: indexing w[e] per expert would make backward build E full-size gradient buffers.
    # With enough rows per expert, one (2F, D) matmul for gate and up beats two (F, D) ones, even after
    # paying for the concatenated copy of the weights.
    fuse = _fuse_gate_up(order_S.numel(), num_experts)
    if fuse:
        w_gu = torch.cat([w_gate_EFD, w_up_EFD], dim=1).unbind(0)
    else:
        w_gate, w_up = w_gate_EFD.unbind(0), w_up_EFD.unbind(0)
    w_down = w_down_EDF.unbind(0)
    outs: list[torch.Tensor] = []
    # split, not slicing: a slice's backward fills a zero buffer the size of x_SD per expert and adds them
    # up (E full-size fills per layer); split's backward is one concatenation.
    for e, xs_ND in enumerate(x_SD.split(counts)):
        if xs_ND.shape[0] == 0:
            continue
        if fuse:
            gate_NF, up_NF = F.linear(xs_ND, w_gu[e]).split(f, dim=1)
            h_NF = F.silu(gate_NF) * up_NF
        else:
            h_NF = F.silu(F.linear(xs_ND, w_gate[e])) * F.linear(xs_ND, w_up[e])
        outs.append(F.linear(h_NF, w_down[e]))
    if not outs:
        return torch.zeros_like(x_TD)
    # combine: back to (token, slot) order, weight by the gates, sum the K slots of each token
    y_TKD = _PermuteRows.apply(torch.cat(outs), inverse_S, order_S).view(num_tokens, top_k, -1)
    return (y_TKD * topk_weights_TK.to(x_TD.dtype).unsqueeze(-1)).sum(dim=1)


def _fuse_gate_up(num_rows: int, num_experts: int) -> bool:
    """With enough rows per expert, one (2F, D) matmul for gate and up beats two (F, D) ones."""
    return num_rows >= _FUSE_ROWS_PER_EXPERT * num_experts


def _grouped_mm_applies(*tensors: torch.Tensor) -> bool:
    """A CPU `grouped_mm` kernel for these tensors (on other devices the kernels round differently from the
    per-expert loop; float64 has none)."""
    return (
        hasattr(F, "grouped_mm")
        and all(t.device.type == "cpu" for t in tensors)
        and tensors[0].dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _swiglu_sorted(
    x_SD: torch.Tensor, ends_E: torch.Tensor, w_gate_EFD: torch.Tensor, w_up_EFD: torch.Tensor, w_down_EDF: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up, h = silu(gate) * up and y = down(h) of rows grouped by expert (`ends_E`: each group's end)."""
    # Never fused into one (2F, D) call: the concatenated copy of the weights (the 100M policy's: 31 MB a
    # layer) costs more than the second call saves, and the outputs are the same bits either way (measured
    # on 2 Zen1 cores, 16 experts of (320, 768), one thread: 512 rows 28-32 ms fused against 21 ms,
    # 2,048 rows 81-88 ms against 69-77 ms).
    gate_SF = F.grouped_mm(x_SD, w_gate_EFD.transpose(1, 2), offs=ends_E)
    up_SF = F.grouped_mm(x_SD, w_up_EFD.transpose(1, 2), offs=ends_E)
    h_SF = F.silu(gate_SF) * up_SF
    return gate_SF, up_SF, h_SF, F.grouped_mm(h_SF, w_down_EDF.transpose(1, 2), offs=ends_E)


class _GroupedSwiGLU(torch.autograd.Function):
    """`_swiglu_sorted`'s y with a backward of grouped matmuls: one call per projection for all experts."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x_SD: torch.Tensor,
        ends_E: torch.Tensor,
        w_gate_EFD: torch.Tensor,
        w_up_EFD: torch.Tensor,
        w_down_EDF: torch.Tensor,
    ) -> torch.Tensor:
        gate_SF, up_SF, h_SF, y_SD = _swiglu_sorted(x_SD, ends_E, w_gate_EFD, w_up_EFD, w_down_EDF)
        ctx.save_for_backward(x_SD, ends_E, w_gate_EFD, w_up_EFD, w_down_EDF, gate_SF, up_SF, h_SF)
        return y_SD

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_y_SD: torch.Tensor):  # type: ignore[override]
        x_SD, ends_E, w_gate_EFD, w_up_EFD, w_down_EDF, gate_SF, up_SF, h_SF = ctx.saved_tensors  # type: ignore[attr-defined]
        need_x, _, need_gate, need_up, need_down = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_y_SD = grad_y_SD.contiguous()
        grad_h_SF = F.grouped_mm(grad_y_SD, w_down_EDF, offs=ends_E)
        sig_SF = torch.sigmoid(gate_SF)
        grad_up_SF = grad_h_SF * (gate_SF * sig_SF)
        # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))), as torch's silu_backward
        grad_gate_SF = grad_h_SF * up_SF * (sig_SF * (1 + gate_SF * (1 - sig_SF)))
        grad_x = None
        if need_x:
            grad_x = F.grouped_mm(grad_gate_SF, w_gate_EFD, offs=ends_E)
            grad_x += F.grouped_mm(grad_up_SF, w_up_EFD, offs=ends_E)
        # weight gradients: per expert, its rows' (out-grad)^T @ input, as one grouped call over the row groups
        grad_gate = F.grouped_mm(grad_gate_SF.t(), x_SD, offs=ends_E) if need_gate else None
        grad_up = F.grouped_mm(grad_up_SF.t(), x_SD, offs=ends_E) if need_up else None
        grad_down = F.grouped_mm(grad_y_SD.t(), h_SF, offs=ends_E) if need_down else None
        return grad_x, None, grad_gate, grad_up, grad_down


def _grouped_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """`reference_experts_forward` on CPU: same sort, same per-expert matmuls (grouped), with or without autograd
    (the same numbers either way)."""
    num_experts = w_gate_EFD.shape[0]
    num_tokens, top_k = topk_ids_TK.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(x_TD)
    flat_S = topk_ids_TK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)
    # grouped_mm's group ends: row offsets where each expert's rows stop (empty experts repeat an offset)
    ends_E = torch.bincount(flat_S, minlength=num_experts).cumsum(0, dtype=torch.int32)
    weights = (w_gate_EFD, w_up_EFD, w_down_EDF)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_TD, *weights)):
        # dispatch and combine as permutations of the T*K rows, whose backward is the inverse gather (no
        # scatter-add); the same rows as the no-grad path's index_select
        inverse_S = torch.empty_like(order_S)
        inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
        x_TKD = x_TD.unsqueeze(1).expand(num_tokens, top_k, x_TD.shape[1]).reshape(num_tokens * top_k, -1)
        y_SD = _GroupedSwiGLU.apply(_PermuteRows.apply(x_TKD, order_S, inverse_S), ends_E, *weights)
        y_TKD = _PermuteRows.apply(y_SD, inverse_S, order_S).view(num_tokens, top_k, -1)
    else:
        x_SD = x_TD.index_select(0, order_S // top_k)
        y_SD = _swiglu_sorted(x_SD, ends_E, *weights)[3]
        y_TKD = torch.empty_like(y_SD).index_copy_(0, order_S, y_SD).view(num_tokens, top_k, -1)
    # weight by the gates, sum the K slots of each token
    return (y_TKD * topk_weights_TK.to(x_TD.dtype).unsqueeze(-1)).sum(dim=1)
