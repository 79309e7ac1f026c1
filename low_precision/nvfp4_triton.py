"""Triton NVFP4 quantizers (per-token rows, per-expert weights), each kernel beside its launcher.

Byte-identical to :mod:`low_precision.nvfp4`, its rule for non-finite rows included (a NaN or inf anywhere in
a row or expert makes it all NaN: scales 0x7F, codes 0, global amax NaN). Hardware max drops NaN, so the
amax kernels carry a NaN flag of their own. Every quotient is ``tl.div_rn`` (IEEE round-to-nearest);
the source of these kernels holds no division operator and no approximate math, which a test enforces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from low_precision._checks import check_contiguous, check_dtype, check_multiple, check_rank
from low_precision._triton_formats import INF, as_loadable, decode_e4m3, encode_e2m1, encode_e4m3, load_f32, quiet_nan
from low_precision.nvfp4 import NVFP4_BLOCK, NVFP4Tensor

__all__ = ["triton_nvfp4_quantize", "triton_nvfp4_quantize_experts"]


@triton.jit
def _row_amax_kernel(
    x_ptr, amax_ptr, num_rows, num_cols, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IS_BF16: tl.constexpr
):
    """amax_ptr[r] = max |x[r, :]| over a contiguous (num_rows, num_cols) matrix; NaN if the row holds one."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    num_nan = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, num_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        offs = rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
        mask = row_ok[:, None] & (cols < num_cols)[None, :]
        x = load_f32(x_ptr, offs, mask, IS_BF16)
        acc = tl.maximum(acc, tl.max(tl.abs(x), axis=1))
        num_nan += tl.sum((x != x).to(tl.int32), axis=1)
    tl.store(amax_ptr + rows, tl.where(num_nan > 0, quiet_nan(acc), acc), mask=row_ok)


@triton.jit
def _nvfp4_encode_scale(amax):
    """(S_enc, global_amax) from an amax: S_enc = 2688 / max(amax, 1e-12), 1 where 0 or inf; global_amax
    NaN where amax is NaN or inf."""
    clamped = tl.maximum(amax, 1e-12)
    s_enc = tl.div_rn(tl.zeros_like(clamped) + 2688.0, clamped)
    bad = (s_enc == 0.0) | (s_enc == INF)
    global_amax = tl.where(bad, 2688.0, clamped)
    non_finite = (amax != amax) | (amax == INF)
    return tl.where(bad, 1.0, s_enc), tl.where(non_finite, quiet_nan(global_amax), global_amax)


@triton.jit
def _nvfp4_quant_kernel(
    x_ptr, amax_ptr, packed_ptr, scales_ptr, global_ptr, num_rows, num_cols, rows_per_scale,
    BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows x BLOCKS blocks of 16, as (rows, blocks, 8 pairs) even/odd tiles."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    num_blocks = num_cols // 16
    row_ok = rows < num_rows
    mask2 = row_ok[:, None] & (blks < num_blocks)[None, :]
    mask3 = mask2[:, :, None]
    pairs = blks[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    offs = rows.to(tl.int64)[:, None, None] * num_cols + 2 * pairs
    x_even = load_f32(x_ptr, offs, mask3, IS_BF16)
    x_odd = load_f32(x_ptr, offs + 1, mask3, IS_BF16)
    amax = tl.load(amax_ptr + rows // rows_per_scale, mask=row_ok, other=0.0)
    s_enc, global_amax = _nvfp4_encode_scale(amax)
    amax_b = tl.maximum(tl.max(tl.abs(x_even), axis=2), tl.max(tl.abs(x_odd), axis=2))
    scale_code = encode_e4m3(tl.minimum(amax_b * (s_enc * 0.16666666666666666)[:, None], 448.0))
    dec = decode_e4m3(scale_code)
    enc = tl.where(
        dec == 0.0, 0.0, tl.div_rn(tl.broadcast_to(s_enc[:, None], dec.shape), tl.where(dec == 0.0, 1.0, dec))
    )
    lo = encode_e2m1(tl.minimum(tl.maximum(x_even * enc[:, :, None], -6.0), 6.0))
    hi = encode_e2m1(tl.minimum(tl.maximum(x_odd * enc[:, :, None], -6.0), 6.0))
    row_finite = (amax == amax) & (amax != INF)  # else the whole row is NaN: scales 0x7F, codes 0
    scale_code = tl.where(row_finite[:, None], scale_code, 0x7F)
    lo = tl.where(row_finite[:, None, None], lo, 0)
    hi = tl.where(row_finite[:, None, None], hi, 0)
    packed_offs = rows.to(tl.int64)[:, None, None] * (num_cols // 2) + pairs
    tl.store(packed_ptr + packed_offs, (lo | (hi << 4)).to(tl.uint8), mask=mask3)
    scale_offs = rows.to(tl.int64)[:, None] * num_blocks + blks[None, :]
    tl.store(scales_ptr + scale_offs, scale_code.to(tl.uint8), mask=mask2)
    first = row_ok & ((rows * 0 + tl.program_id(1)) == 0)  # rows sharing a scale write the same value
    tl.store(global_ptr + rows // rows_per_scale, global_amax, mask=first)


def _launch(x_RK: torch.Tensor, amax_G: torch.Tensor, rows_per_scale: int, block_m: int, blocks: int) -> NVFP4Tensor:
    rows, cols = x_RK.shape
    device = x_RK.device
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, cols // NVFP4_BLOCK, dtype=torch.uint8, device=device)
    global_amax = torch.empty(amax_G.numel(), dtype=torch.float32, device=device)
    if rows and cols:
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols // NVFP4_BLOCK, blocks))
        _nvfp4_quant_kernel[grid](
            as_loadable(x_RK), amax_G, packed, scales, global_amax, rows, cols, rows_per_scale,
            BLOCK_M=block_m, BLOCKS=blocks, IS_BF16=x_RK.dtype == torch.bfloat16,
        )  # fmt: skip
    return NVFP4Tensor(packed=packed, block_scales=scales, global_amax=global_amax)


def _row_amax(x_RC: torch.Tensor, block_m: int = 16, block_k: int = 256) -> torch.Tensor:
    rows, cols = x_RC.shape
    amax = torch.zeros(rows, dtype=torch.float32, device=x_RC.device)
    if rows and cols:
        _row_amax_kernel[(triton.cdiv(rows, block_m),)](
            as_loadable(x_RC), amax, rows, cols,
            BLOCK_M=block_m, BLOCK_K=block_k, IS_BF16=x_RC.dtype == torch.bfloat16,
        )  # fmt: skip
    return amax


def _check(name: str, x: torch.Tensor, rank: int, legend: str) -> None:
    check_dtype(name, x, (torch.bfloat16, torch.float32))
    check_rank(name, x, rank, legend)
    check_contiguous(name, x)
    check_multiple(name, x.shape[-1], NVFP4_BLOCK, "last dim")


def triton_nvfp4_quantize(x_RK: torch.Tensor, block_m: int = 16, blocks: int = 8) -> NVFP4Tensor:
    """Per-token NVFP4 of a contiguous 2-D bf16/fp32 tensor (same bytes as ``nvfp4_quantize``).

    Raises:
        KernelDTypeError, KernelShapeError, KernelStrideError: on a bad input.
    """
    _check("x_RK", x_RK, 2, "rows x reduction dim")
    return _launch(x_RK, _row_amax(x_RK), 1, block_m, blocks)


def triton_nvfp4_quantize_experts(w_ENK: torch.Tensor, block_m: int = 16, blocks: int = 8) -> NVFP4Tensor:
    """Per-expert NVFP4 of expert weights (E, N, K) along K (same bytes as ``nvfp4_quantize_experts``)."""
    _check("w_ENK", w_ENK, 3, "experts x out x reduction dim")
    num_experts, rows, cols = w_ENK.shape
    amax = _row_amax(w_ENK.view(num_experts, rows * cols))
    q = _launch(w_ENK.view(num_experts * rows, cols), amax, max(rows, 1), block_m, blocks)
    return NVFP4Tensor(
        packed=q.packed.view(num_experts, rows, cols // 2),
        block_scales=q.block_scales.view(num_experts, rows, cols // NVFP4_BLOCK),
        global_amax=q.global_amax,
    )
