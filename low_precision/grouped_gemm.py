"""Grouped GEMMs over experts, emulated in torch on dequantized operands (the numerics reference).

Rows of the activation operand are sorted by expert; ``offsets_E1`` gives each expert's row range.
- :func:`nvfp4_grouped_mm`: out[m] = A[m] @ B[e]^T for NVFP4 A (per-row scale) and B (per-expert
  scale); the product of the unscaled values is multiplied in the epilogue by
  row_amax_A[m] * amax_B[e] / 2688^2.
- :func:`mxfp8_grouped_mm`: the same with MXFP8 operands quantized along K (input gradients).
- :func:`mxfp8_grouped_wgrad`: out[e] = G_e^T @ X_e, reducing over each expert's tokens, with both
  operands quantized along tokens in the 32-aligned padded layout (weight gradients).
Empty experts give empty row ranges (forward) or zero gradients (weight gradient).
"""

from __future__ import annotations

import torch

from low_precision._checks import check_dtype, check_offsets, check_rank, check_size
from low_precision.errors import KernelShapeError
from low_precision.mxfp8 import MXTensor, mxfp8_dequantize
from low_precision.nvfp4 import NVFP4_GLOBAL, NVFP4Tensor, nvfp4_unscaled_values

__all__ = ["expert_of_rows", "mxfp8_grouped_mm", "mxfp8_grouped_wgrad", "nvfp4_grouped_mm"]


def expert_of_rows(offsets_E1: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Expert index (int64) of each of the ``num_rows`` sorted rows."""
    sizes = (offsets_E1[1:] - offsets_E1[:-1]).to(torch.int64)
    experts = torch.arange(sizes.numel(), device=offsets_E1.device)
    return torch.repeat_interleave(experts, sizes, output_size=num_rows)


def _grouped_matmul(a_MK: torch.Tensor, b_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    out = a_MK.new_zeros(a_MK.shape[0], b_ENK.shape[1])
    bounds = offsets_E1.tolist()
    for e in range(b_ENK.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[start:end] = a_MK[start:end] @ b_ENK[e].t()
    return out


def _check_pair(a_cols: int, b: torch.Tensor, offsets_E1: torch.Tensor, num_rows: int) -> None:
    check_rank("b", b, 3, "experts x out x reduction dim")
    if b.shape[2] != a_cols:
        raise KernelShapeError(f"reduction dims differ: A has {a_cols} columns, B has shape {tuple(b.shape)}")
    check_offsets("offsets_E1", offsets_E1, num_rows)
    check_size("offsets_E1", offsets_E1, 0, b.shape[0] + 1, "num_experts + 1")


def nvfp4_grouped_mm(a: NVFP4Tensor, b: NVFP4Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """float32 (M, N) = grouped A @ B^T of per-token NVFP4 A (M, K) and per-expert NVFP4 B (E, N, K)."""
    check_rank("a.packed", a.packed, 2, "rows x K/2")
    num_rows = a.packed.shape[0]
    _check_pair(a.packed.shape[1], b.packed, offsets_E1, num_rows)
    out = _grouped_matmul(nvfp4_unscaled_values(a), nvfp4_unscaled_values(b), offsets_E1)
    b_amax = b.global_amax[expert_of_rows(offsets_E1, num_rows)]
    epilogue = (a.global_amax * b_amax) / torch.tensor(NVFP4_GLOBAL * NVFP4_GLOBAL, device=out.device)
    return out * epilogue[:, None]


def mxfp8_grouped_mm(a: MXTensor, b: MXTensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """float32 (M, N) = grouped A @ B^T; A (M, K) and B (E, N, K) MXFP8 quantized along K."""
    check_rank("a.codes", a.codes, 2, "rows x K")
    if a.dim != -1 or b.dim != -1:
        raise KernelShapeError("both operands must be quantized along K (dim=-1)")
    _check_pair(a.codes.shape[1], b.codes, offsets_E1, a.codes.shape[0])
    return _grouped_matmul(mxfp8_dequantize(a), mxfp8_dequantize(b), offsets_E1)


def mxfp8_grouped_wgrad(g: MXTensor, x: MXTensor, padded_offsets_E1: torch.Tensor) -> torch.Tensor:
    """float32 (E, N, Q): out[e] = G_e^T @ X_e over each expert's padded rows; both along dim 0."""
    check_rank("g.codes", g.codes, 2, "padded rows x N")
    check_rank("x.codes", x.codes, 2, "padded rows x Q")
    check_dtype("padded_offsets_E1", padded_offsets_E1, (torch.int32, torch.int64))
    if g.dim != 0 or x.dim != 0:
        raise KernelShapeError("weight-gradient operands must be quantized along tokens (dim=0)")
    if g.codes.shape[0] != x.codes.shape[0]:
        raise KernelShapeError(f"row counts differ: {tuple(g.codes.shape)} vs {tuple(x.codes.shape)}")
    g_vals, x_vals = mxfp8_dequantize(g), mxfp8_dequantize(x)
    num_experts = padded_offsets_E1.numel() - 1
    out = g_vals.new_zeros(num_experts, g_vals.shape[1], x_vals.shape[1])
    bounds = padded_offsets_E1.tolist()
    for e in range(num_experts):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[e] = g_vals[start:end].t() @ x_vals[start:end]
    return out
