"""SwiGLU MoE experts: one signature, three precisions.

    experts_forward(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF) -> y_TD
    y[t] = sum_k weight[t, k] * W_down[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),  e = topk_ids[t, k]

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k, M = T*K routed pairs (sorted by
expert, see :mod:`low_precision.routing`).

- REFERENCE: plain torch in the activations' dtype (bf16 or fp32); autograd does the backward.
- EMULATED / TRITON: :class:`QuantizedExperts`, a custom autograd op. Forward: activations in NVFP4
  with a per-token FP32 scale, weights in NVFP4 with a per-expert scale, both blocked along the
  reduction dim. Backward: gradients and saved operands in MXFP8 (block 32) along each GEMM's
  reduction dim: D for dh = dy W_down, F for dx = dg W_gate + du W_up, tokens for every weight
  gradient. EMULATED runs the torch reference of the formats and GEMMs; TRITON the Triton kernels
  (CUDA, or CPU under TRITON_INTERPRET=1). Master weights stay bf16/fp32; gradients come back in the
  dtype of each input.

Every path combines the K expert results of a token with :func:`low_precision.routing.combine_rows`: a sorted
segment sum, bit-identical run to run, when ``torch.use_deterministic_algorithms(True)`` is on.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial

import structlog
import torch
import torch.nn.functional as F

from low_precision import _backends
from low_precision._backends import QuantBackend, take_rows
from low_precision._checks import check_dtype, check_multiple, check_rank, check_size
from low_precision.formats import ScaleMode
from low_precision.mxfp8 import padded_group_layout
from low_precision.routing import Routing, combine_rows, route

__all__ = [
    "ExpertsFn",
    "ExpertsPrecision",
    "QuantizedExperts",
    "experts_forward_emulated",
    "experts_forward_reference",
    "experts_forward_triton",
    "make_experts_fn",
]

log = structlog.get_logger(__name__)

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_QUANT_DTYPES = (torch.bfloat16, torch.float32)
_REF_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


class ExpertsPrecision(enum.Enum):
    """Which implementation computes the experts."""

    REFERENCE = "reference"
    EMULATED = "emulated"
    TRITON = "triton"


def _check_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, block: int, dtypes=_QUANT_DTYPES) -> None:
    check_rank("x_TD", x, 2, "tokens x hidden")
    check_dtype("x_TD", x, dtypes)
    check_rank("topk_weights_TK", topk_weights, 2, "tokens x top-k")
    check_size("topk_weights_TK", topk_weights, 0, x.shape[0], "tokens of x_TD")
    check_rank("topk_ids_TK", topk_ids, 2, "tokens x top-k")
    check_size("topk_ids_TK", topk_ids, 0, x.shape[0], "tokens of x_TD")
    check_size("topk_ids_TK", topk_ids, 1, topk_weights.shape[1], "top-k of topk_weights_TK")
    for name, w in (("w_gate_EFD", w_gate), ("w_up_EFD", w_up), ("w_down_EDF", w_down)):
        check_rank(name, w, 3, "experts x out x in")
        check_dtype(name, w, dtypes)
    num_experts, inter, hidden = w_gate.shape
    check_size("x_TD", x, 1, hidden, "hidden size D of w_gate_EFD")
    for name, w, shape in (("w_up_EFD", w_up, (num_experts, inter, hidden)),
                           ("w_down_EDF", w_down, (num_experts, hidden, inter))):  # fmt: skip
        for dim, size in enumerate(shape):
            check_size(name, w, dim, size, f"dim {dim} of (E, F, D) = {(num_experts, inter, hidden)}")
    if block > 1:
        check_multiple("x_TD", hidden, block, "hidden size D")
        check_multiple("w_gate_EFD", inter, block, "intermediate size F")


def experts_forward_reference(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """Plain torch SwiGLU experts in the dtype of ``x_TD`` (bf16, fp32, or fp64 for tests); autograd."""
    _check_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, block=1, dtypes=_REF_DTYPES)
    routing = route(topk_ids_TK, w_gate_EFD.shape[0])
    dtype = x_TD.dtype
    x_MD = x_TD[routing.token_M]
    bounds = routing.offsets_E1.tolist()
    pieces = []
    for e in range(w_gate_EFD.shape[0]):
        x_e = x_MD[bounds[e] : bounds[e + 1]]
        h_e = F.silu(x_e @ w_gate_EFD[e].to(dtype).t()) * (x_e @ w_up_EFD[e].to(dtype).t())
        pieces.append(h_e @ w_down_EDF[e].to(dtype).t())
    y_MD = torch.cat(pieces) if pieces else x_MD
    w_M = topk_weights_TK.reshape(-1)[routing.pair_M].to(dtype)
    return combine_rows(routing, y_MD * w_M[:, None], x_TD.shape[0])


class QuantizedExperts(torch.autograd.Function):
    """NVFP4 forward / MXFP8 backward SwiGLU experts over a precomputed :class:`Routing`."""

    @staticmethod
    def forward(ctx, x_TD, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, routing, backend, mx_mode):
        off, token = routing.offsets_E1, routing.token_M
        xq_M = take_rows(backend.nvfp4_rows(x_TD.contiguous()), token)
        g_MF = backend.nvfp4_mm(xq_M, backend.nvfp4_experts(w_gate_EFD.contiguous()), off)
        u_MF = backend.nvfp4_mm(xq_M, backend.nvfp4_experts(w_up_EFD.contiguous()), off)
        h_MF = F.silu(g_MF) * u_MF
        hq_M = backend.nvfp4_rows(h_MF)
        y_MD = backend.nvfp4_mm(hq_M, backend.nvfp4_experts(w_down_EDF.contiguous()), off)
        w_M = topk_weights_TK.reshape(-1)[routing.pair_M].float()
        y_TD = combine_rows(routing, y_MD * w_M[:, None], x_TD.shape[0])
        ctx.save_for_backward(x_TD, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, g_MF, u_MF, h_MF, y_MD)
        ctx.routing, ctx.backend, ctx.mx_mode = routing, backend, mx_mode
        return y_TD.to(x_TD.dtype)

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, topk_w, w_gate, w_up, w_down, g_MF, u_MF, h_MF, y_MD = ctx.saved_tensors
        need_x, need_topk, need_gate, need_up, need_down = ctx.needs_input_grad[:5]
        routing: Routing = ctx.routing
        b: QuantBackend = ctx.backend
        mode: ScaleMode = ctx.mx_mode
        off, token = routing.offsets_E1, routing.token_M
        dy_gathered = dy_TD.float()[token]
        d_topk = None
        if need_topk:
            d_topk = torch.zeros(topk_w.numel(), dtype=torch.float32, device=dy_TD.device)
            d_topk[routing.pair_M] = (dy_gathered * y_MD).sum(-1)
            d_topk = d_topk.reshape(topk_w.shape).to(topk_w.dtype)
        dy_MD = dy_gathered * topk_w.reshape(-1)[routing.pair_M].float()[:, None]
        layout = padded_group_layout(off, routing.num_rows)
        cols = partial(b.mx_grouped_cols, layout=layout, mode=mode)
        poff = layout.padded_offsets_E1
        dw_down = b.mx_wgrad(cols(dy_MD), cols(h_MF), poff).to(w_down.dtype) if need_down else None  # (E, D, F)
        dx_TD = dw_gate = dw_up = None
        if need_x or need_gate or need_up:
            w_down_T = b.mx_experts(w_down.transpose(1, 2).contiguous(), mode)  # (E, F, D), along D
            dh_MF = b.mx_mm(b.mx_rows(dy_MD, mode), w_down_T, off)
            sig = torch.sigmoid(g_MF)
            dg_MF = dh_MF * u_MF * sig * (1.0 + g_MF * (1.0 - sig))  # d silu(g) = sig (1 + g (1 - sig))
            du_MF = dh_MF * g_MF * sig
            if need_x:
                dx_TD = _input_grad(b, mode, x_TD, routing, dg_MF, du_MF, w_gate, w_up)
            x_cols = cols(x_TD[token].contiguous()) if need_gate or need_up else None
            if need_gate:
                dw_gate = b.mx_wgrad(cols(dg_MF), x_cols, poff).to(w_gate.dtype)  # (E, F, D)
            if need_up:
                dw_up = b.mx_wgrad(cols(du_MF), x_cols, poff).to(w_up.dtype)
        return dx_TD, d_topk, dw_gate, dw_up, dw_down, None, None, None


def _input_grad(b, mode, x_TD, routing, dg_MF, du_MF, w_gate, w_up) -> torch.Tensor:
    """dx[t] = sum over t's pairs of dg W_gate[e] + du W_up[e], reducing over F in MXFP8."""
    off = routing.offsets_E1
    w_gate_T = b.mx_experts(w_gate.transpose(1, 2).contiguous(), mode)  # (E, D, F), along F
    w_up_T = b.mx_experts(w_up.transpose(1, 2).contiguous(), mode)
    dx_MD = b.mx_mm(b.mx_rows(dg_MF, mode), w_gate_T, off)
    dx_MD += b.mx_mm(b.mx_rows(du_MF, mode), w_up_T, off)
    return combine_rows(routing, dx_MD, x_TD.shape[0]).to(x_TD.dtype)


def _quantized_forward(
    backend: QuantBackend,
    mx_mode: ScaleMode,
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    _check_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, block=32)
    backend.check_device(x_TD.device)
    routing = route(topk_ids_TK, w_gate_EFD.shape[0])
    return QuantizedExperts.apply(x_TD, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, routing, backend, mx_mode)


def experts_forward_emulated(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """NVFP4 forward / MXFP8 (RCEIL) backward, emulated in torch. D and F must be multiples of 32."""
    return _quantized_forward(
        _backends.EMULATED, ScaleMode.RCEIL, x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF
    )


def experts_forward_triton(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """NVFP4 forward / MXFP8 (RCEIL) backward with the Triton kernels. D and F multiples of 32."""
    return _quantized_forward(
        _backends.TRITON, ScaleMode.RCEIL, x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF
    )


class _TritonExperts:
    """Looks the Triton backend up at call time, so kernels re-created for the interpreter are used."""

    def __init__(self, mx_scale_mode: ScaleMode) -> None:
        self.mx_scale_mode = mx_scale_mode

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
        return _quantized_forward(
            _backends.TRITON, self.mx_scale_mode, x_TD, topk_ids_TK, topk_weights_TK,
            w_gate_EFD, w_up_EFD, w_down_EDF,
        )  # fmt: skip


def make_experts_fn(mode: ExpertsPrecision, mx_scale_mode: ScaleMode = ScaleMode.RCEIL) -> ExpertsFn:
    """The experts function for a precision mode; all share the signature of the module docstring.

    Raises:
        TypeError: ``mode`` is not an :class:`ExpertsPrecision`.
    """
    if not isinstance(mode, ExpertsPrecision):
        raise TypeError(f"mode must be an ExpertsPrecision ({[m.name for m in ExpertsPrecision]}); got {mode!r}")
    log.info("experts_fn_selected", mode=mode.value, mx_scale_mode=mx_scale_mode.value)
    if mode is ExpertsPrecision.REFERENCE:
        return experts_forward_reference
    if mode is ExpertsPrecision.EMULATED:
        return partial(_quantized_forward, _backends.EMULATED, mx_scale_mode)
    return _TritonExperts(mx_scale_mode)
