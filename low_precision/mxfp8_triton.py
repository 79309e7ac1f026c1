"""Triton MXFP8 quantizers (rows, and grouped columns), each beside its launcher.

They produce the same bytes as :mod:`low_precision.mxfp8` (the torch reference); tests check this under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from low_precision._checks import check_contiguous, check_dtype, check_multiple, check_rank
from low_precision._triton_formats import as_loadable, e8m0_scale, load_f32, mx_encode, nan_aware_amax
from low_precision.formats import ScaleMode
from low_precision.mxfp8 import MX_BLOCK, MXTensor, PaddedGroups

__all__ = ["triton_mxfp8_quantize_experts", "triton_mxfp8_quantize_grouped_cols", "triton_mxfp8_quantize_rows"]


@triton.jit
def _mxfp8_rows_kernel(
    x_ptr, codes_ptr, scales_ptr, num_rows, num_cols,
    BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, IS_RCEIL: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    """One program: a (BLOCK_M rows, BLOCKS scale blocks, 32) tile; amax over the last axis."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    num_blocks = num_cols // 32
    mask = (rows < num_rows)[:, None, None] & (blks < num_blocks)[None, :, None]
    cols = blks[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    offs = rows.to(tl.int64)[:, None, None] * num_cols + cols
    x = load_f32(x_ptr, offs, mask, IS_BF16)
    e = e8m0_scale(nan_aware_amax(x, 2), IS_RCEIL)
    tl.store(codes_ptr + offs, mx_encode(x, e).to(tl.uint8), mask=mask)
    scale_offs = rows.to(tl.int64)[:, None, None] * num_blocks + blks[None, :, None]
    tl.store(scales_ptr + scale_offs, e.to(tl.uint8), mask=mask)


def triton_mxfp8_quantize_rows(
    x_MK: torch.Tensor, mode: ScaleMode = ScaleMode.RCEIL, block_m: int = 32, blocks: int = 4
) -> MXTensor:
    """MXFP8 along the last dim of a contiguous 2-D bf16/fp32 tensor (K a multiple of 32).

    Raises:
        KernelDTypeError, KernelShapeError, KernelStrideError: on a bad input.
    """
    check_dtype("x_MK", x_MK, (torch.bfloat16, torch.float32))
    check_rank("x_MK", x_MK, 2, "rows x reduction dim")
    check_contiguous("x_MK", x_MK)
    rows, cols = x_MK.shape
    check_multiple("x_MK", cols, MX_BLOCK, "last dim")
    codes = torch.empty(rows, cols, dtype=torch.uint8, device=x_MK.device)
    scales = torch.empty(rows, cols // MX_BLOCK, dtype=torch.uint8, device=x_MK.device)
    if rows and cols:
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols // MX_BLOCK, blocks))
        _mxfp8_rows_kernel[grid](
            as_loadable(x_MK), codes, scales, rows, cols, BLOCK_M=block_m, BLOCKS=blocks,
            IS_RCEIL=mode is ScaleMode.RCEIL, IS_BF16=x_MK.dtype == torch.bfloat16,
        )  # fmt: skip
    return MXTensor(codes=codes, scales=scales, dim=-1, mode=mode)


def triton_mxfp8_quantize_experts(w_ENK: torch.Tensor, mode: ScaleMode = ScaleMode.RCEIL) -> MXTensor:
    """MXFP8 of expert weights (E, N, K) along K: codes (E, N, K), scales (E, N, K/32)."""
    check_rank("w_ENK", w_ENK, 3, "experts x out x reduction dim")
    num_experts, rows, cols = w_ENK.shape
    check_contiguous("w_ENK", w_ENK)
    mx = triton_mxfp8_quantize_rows(w_ENK.view(num_experts * rows, cols), mode)
    return MXTensor(
        codes=mx.codes.view(num_experts, rows, cols),
        scales=mx.scales.view(num_experts, rows, cols // MX_BLOCK),
        dim=-1,
        mode=mode,
    )


@triton.jit
def _mxfp8_grouped_cols_kernel(
    x_ptr, src_rows_ptr, codes_ptr, scales_ptr, num_padded, num_cols,
    BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, IS_RCEIL: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    """One program: a (BLOCKS scale rows, 32 padded rows, BLOCK_N columns) tile gathered from the
    source rows; amax over the middle axis."""
    blks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    prow = blks[:, None] * 32 + tl.arange(0, 32)[None, :]
    row_ok = prow < num_padded
    src = tl.load(src_rows_ptr + prow, mask=row_ok, other=-1)[:, :, None]
    col_ok = (cols < num_cols)[None, None, :]
    x = load_f32(x_ptr, tl.maximum(src, 0).to(tl.int64) * num_cols + cols[None, None, :], (src >= 0) & col_ok, IS_BF16)
    e = e8m0_scale(nan_aware_amax(x, 1), IS_RCEIL)
    dst = prow.to(tl.int64)[:, :, None] * num_cols + cols[None, None, :]
    tl.store(codes_ptr + dst, mx_encode(x, e).to(tl.uint8), mask=row_ok[:, :, None] & col_ok)
    scale_offs = blks.to(tl.int64)[:, None, None] * num_cols + cols[None, None, :]
    tl.store(scales_ptr + scale_offs, e.to(tl.uint8), mask=(blks * 32 < num_padded)[:, None, None] & col_ok)


def triton_mxfp8_quantize_grouped_cols(
    x_MN: torch.Tensor, layout: PaddedGroups, mode: ScaleMode = ScaleMode.RCEIL, blocks: int = 2, block_n: int = 64
) -> MXTensor:
    """MXFP8 along dim 0 in per-group blocks of 32 (the padded layout of :func:`padded_group_layout`).

    Returns codes (P, N) and scales (P/32, N) like :func:`low_precision.mxfp8.mxfp8_quantize_grouped_cols`.
    """
    check_dtype("x_MN", x_MN, (torch.bfloat16, torch.float32))
    check_rank("x_MN", x_MN, 2, "tokens x features")
    check_contiguous("x_MN", x_MN)
    src = layout.src_rows_P
    check_dtype("layout.src_rows_P", src, (torch.int32, torch.int64))
    check_multiple("layout.src_rows_P", src.numel(), MX_BLOCK, "padded row count")
    num_padded, cols = src.numel(), x_MN.shape[1]
    codes = torch.empty(num_padded, cols, dtype=torch.uint8, device=x_MN.device)
    scales = torch.empty(num_padded // MX_BLOCK, cols, dtype=torch.uint8, device=x_MN.device)
    if num_padded and cols:
        src_arg = src.contiguous() if x_MN.shape[0] else torch.full_like(src, -1)
        grid = (triton.cdiv(num_padded // MX_BLOCK, blocks), triton.cdiv(cols, block_n))
        _mxfp8_grouped_cols_kernel[grid](
            as_loadable(x_MN), src_arg, codes, scales, num_padded, cols, BLOCKS=blocks,
            BLOCK_N=block_n, IS_RCEIL=mode is ScaleMode.RCEIL, IS_BF16=x_MN.dtype == torch.bfloat16,
        )  # fmt: skip
    return MXTensor(codes=codes, scales=scales, dim=0, mode=mode)
