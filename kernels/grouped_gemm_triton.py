"""Triton grouped GEMMs over experts, each kernel beside its launcher.

- ``_nvfp4_grouped_mm_kernel``: forward, out[m] = A[m] @ B[e]^T with NVFP4 A (per-token scale) and B
  (per-expert scale). FP4 pairs are decoded with bit operations (the interpreter decodes e2m1
  ``dot_scaled`` operands wrongly); even and odd K elements are multiplied as two dots, which is the
  same sum. The per-token x per-expert scale is applied in the epilogue with ``tl.div_rn``.
- ``_mxfp8_grouped_mm_kernel``: input gradients, MXFP8 A (M, K) and B (E, N, K) quantized along K.
- ``_mxfp8_grouped_wgrad_kernel``: weight gradients, out[e] = G_e^T @ X_e over each expert's
  32-aligned padded token range.

On Hopper (no native MX/NVFP4 MMA) operands are dequantized to bf16 in registers (exact: E2M1 x E4M3
and E4M3 x 2^k fit bf16) and multiplied with fp32 accumulation. On CPU tensors (the interpreter, whose
bf16 ``tl.dot`` returns garbage) the same exact values are multiplied in fp32. Forward tiles over rows are mapped to
experts by a small tile table built on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    check_contiguous,
    check_dtype,
    check_multiple,
    check_offsets,
    check_rank,
    check_same_device,
    check_size,
)
from kernels._triton_formats import decode_e2m1, decode_e4m3, mx_dequant_multiplier
from kernels.errors import KernelShapeError
from kernels.mxfp8 import MX_BLOCK, MXTensor
from kernels.nvfp4 import NVFP4_BLOCK, NVFP4Tensor

__all__ = ["triton_mxfp8_grouped_mm", "triton_mxfp8_grouped_wgrad", "triton_nvfp4_grouped_mm"]


def _tile_map(offsets_E1: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Per row tile: (expert, first row, end row); padding tiles get an empty range."""
    off = offsets_E1.to(torch.int64)
    sizes = off[1:] - off[:-1]
    num_experts = sizes.numel()
    tiles = (sizes + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(num_rows, block_m) + num_experts, device=off.device)
    expert = torch.searchsorted(cum, t, right=True)
    valid = expert < num_experts
    e = torch.clamp(expert, max=num_experts - 1)
    start = off[e] + (t - (cum[e] - tiles[e])) * block_m
    end = off[e + 1]
    zero = torch.zeros_like(t)
    return (
        torch.where(valid, e, zero).to(torch.int32),
        torch.where(valid, start, zero).to(torch.int32),
        torch.where(valid, end, zero).to(torch.int32),
    )


@triton.jit
def _nvfp4_grouped_mm_kernel(
    a_ptr, a_scale_ptr, a_amax_ptr, b_ptr, b_scale_ptr, b_amax_ptr, out_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(tile_end_ptr + tile)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    half_k = K // 2
    num_blocks = K // 16
    a_rows = rows.to(tl.int64)[:, None]
    b_rows = e * N + cols.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, half_k, BLOCK_K // 2):
        kb = k0 + tl.arange(0, BLOCK_K // 2)
        k_ok = (kb < half_k)[None, :]
        a_mask = row_ok[:, None] & k_ok
        b_mask = col_ok[:, None] & k_ok
        a_bytes = tl.load(a_ptr + a_rows * half_k + kb[None, :], mask=a_mask, other=0).to(tl.int32)
        a_dec = decode_e4m3(tl.load(a_scale_ptr + a_rows * num_blocks + (kb // 8)[None, :], mask=a_mask, other=0))
        b_bytes = tl.load(b_ptr + b_rows * half_k + kb[None, :], mask=b_mask, other=0).to(tl.int32)
        b_dec = decode_e4m3(tl.load(b_scale_ptr + b_rows * num_blocks + (kb // 8)[None, :], mask=b_mask, other=0))
        a_lo = decode_e2m1(a_bytes) * a_dec
        a_hi = decode_e2m1(a_bytes >> 4) * a_dec
        b_lo = decode_e2m1(b_bytes) * b_dec
        b_hi = decode_e2m1(b_bytes >> 4) * b_dec
        if DOT_BF16:
            a_lo, a_hi = a_lo.to(tl.bfloat16), a_hi.to(tl.bfloat16)
            b_lo, b_hi = b_lo.to(tl.bfloat16), b_hi.to(tl.bfloat16)
        acc += tl.dot(a_lo, tl.trans(b_lo))
        acc += tl.dot(a_hi, tl.trans(b_hi))
    a_amax = tl.load(a_amax_ptr + rows, mask=row_ok, other=0.0)
    b_amax = tl.load(b_amax_ptr + e)
    epilogue = tl.div_rn(a_amax * b_amax, tl.zeros_like(a_amax) + 7225344.0)  # 2688^2
    out_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + a_rows * N + cols[None, :], acc * epilogue[:, None], mask=out_mask)


def _check_grouped_operands(a_codes, a_scales, b_codes, b_scales, offsets_E1, elems_per_byte, block):
    check_dtype("a codes", a_codes, (torch.uint8,))
    check_dtype("b codes", b_codes, (torch.uint8,))
    check_rank("a codes", a_codes, 2, "rows x K")
    check_rank("b codes", b_codes, 3, "experts x N x K")
    num_rows, k = a_codes.shape[0], a_codes.shape[1] * elems_per_byte
    if b_codes.shape[2] * elems_per_byte != k:
        raise KernelShapeError(
            f"reduction dims differ: A codes {tuple(a_codes.shape)} vs B codes {tuple(b_codes.shape)}"
        )
    check_multiple("A", k, 32, "reduction dim K")
    check_size("a scales", a_scales, 1, k // block, "K / block")
    check_size("a scales", a_scales, 0, num_rows, "rows of A")
    check_size("b scales", b_scales, 2, k // block, "K / block")
    check_offsets("offsets_E1", offsets_E1, num_rows)
    check_size("offsets_E1", offsets_E1, 0, b_codes.shape[0] + 1, "num_experts + 1")
    for name, t in (("a codes", a_codes), ("a scales", a_scales), ("b codes", b_codes), ("b scales", b_scales)):
        check_dtype(name, t, (torch.uint8,))
        check_contiguous(name, t)
    check_same_device(a=a_codes, b=b_codes, a_scales=a_scales, b_scales=b_scales, offsets=offsets_E1)
    return num_rows, k


def triton_nvfp4_grouped_mm(
    a: NVFP4Tensor, b: NVFP4Tensor, offsets_E1: torch.Tensor, block_m: int = 64, block_n: int = 64,
    block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:  # fmt: skip
    """float32 (M, N) grouped A @ B^T (same math as ``grouped_gemm.nvfp4_grouped_mm``).

    Raises:
        KernelDTypeError, KernelShapeError, KernelStrideError: on inconsistent operands.
    """
    num_rows, k = _check_grouped_operands(
        a.packed, a.block_scales, b.packed, b.block_scales, offsets_E1, 2, NVFP4_BLOCK
    )
    check_size("a.global_amax", a.global_amax, 0, num_rows, "rows of A (one scale per token)")
    check_size("b.global_amax", b.global_amax, 0, b.packed.shape[0], "experts (one scale per expert)")
    n = b.packed.shape[1]
    out = torch.empty(num_rows, n, dtype=torch.float32, device=a.packed.device)
    if num_rows and n:
        tiles = _tile_map(offsets_E1, num_rows, block_m)
        grid = (tiles[0].numel(), triton.cdiv(n, block_n))
        _nvfp4_grouped_mm_kernel[grid](
            a.packed, a.block_scales, a.global_amax.float().contiguous(), b.packed, b.block_scales,
            b.global_amax.float().contiguous(), out, *tiles, n, k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_BF16=out.is_cuda,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


@triton.jit
def _mx_tile(
    codes_ptr, scales_ptr, rows, row_stride, cols, scale_rows, scale_cols, scale_stride, mask,
    DOT_BF16: tl.constexpr,
):  # fmt: skip
    """Dequantized tile (bf16, or fp32 in the interpreter): codes[rows, cols] * 2^(scale - 127)."""
    codes = tl.load(codes_ptr + rows * row_stride + cols, mask=mask, other=0)
    scales = tl.load(scales_ptr + scale_rows * scale_stride + scale_cols, mask=mask, other=0)
    values = decode_e4m3(codes) * mx_dequant_multiplier(scales)
    return values.to(tl.bfloat16) if DOT_BF16 else values


@triton.jit
def _mxfp8_grouped_mm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(tile_end_ptr + tile)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = rows.to(tl.int64)[:, None]
    b_rows = e * N + cols.to(tl.int64)[:, None]
    num_blocks = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = (kk < K)[None, :]
        kc = kk[None, :]
        ks = (kk // 32)[None, :]
        a = _mx_tile(a_ptr, a_scale_ptr, a_rows, K, kc, a_rows, ks, num_blocks, row_ok[:, None] & k_ok, DOT_BF16)
        b = _mx_tile(b_ptr, b_scale_ptr, b_rows, K, kc, b_rows, ks, num_blocks, col_ok[:, None] & k_ok, DOT_BF16)
        acc += tl.dot(a, tl.trans(b))
    tl.store(out_ptr + a_rows * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def triton_mxfp8_grouped_mm(
    a: MXTensor, b: MXTensor, offsets_E1: torch.Tensor, block_m: int = 64, block_n: int = 64,
    block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:  # fmt: skip
    """float32 (M, N) grouped A @ B^T for MXFP8 operands quantized along K (input gradients)."""
    if a.dim != -1 or b.dim != -1:
        raise KernelShapeError("both operands must be quantized along K (dim=-1)")
    num_rows, k = _check_grouped_operands(a.codes, a.scales, b.codes, b.scales, offsets_E1, 1, MX_BLOCK)
    n = b.codes.shape[1]
    out = torch.empty(num_rows, n, dtype=torch.float32, device=a.codes.device)
    if num_rows and n:
        tiles = _tile_map(offsets_E1, num_rows, block_m)
        grid = (tiles[0].numel(), triton.cdiv(n, block_n))
        _mxfp8_grouped_mm_kernel[grid](
            a.codes, a.scales, b.codes, b.scales, out, *tiles, n, k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_BF16=out.is_cuda,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


@triton.jit
def _mxfp8_grouped_wgrad_kernel(
    g_ptr, g_scale_ptr, x_ptr, x_scale_ptr, out_ptr, padded_offsets_ptr, N, Q,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, DOT_BF16: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    n_ok = (n < N)[None, :]
    q_ok = (q < Q)[None, :]
    start = tl.load(padded_offsets_ptr + e)
    end = tl.load(padded_offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_Q), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = (p < end)[:, None]
        pr = p.to(tl.int64)[:, None]
        ps = (p // 32).to(tl.int64)[:, None]
        g = _mx_tile(g_ptr, g_scale_ptr, pr, N, n[None, :], ps, n[None, :], N, p_ok & n_ok, DOT_BF16)
        x = _mx_tile(x_ptr, x_scale_ptr, pr, Q, q[None, :], ps, q[None, :], Q, p_ok & q_ok, DOT_BF16)
        acc += tl.dot(tl.trans(g), x)
    out_offs = e.to(tl.int64) * N * Q + n.to(tl.int64)[:, None] * Q + q[None, :]
    tl.store(out_ptr + out_offs, acc, mask=(n < N)[:, None] & q_ok)


def triton_mxfp8_grouped_wgrad(
    g: MXTensor, x: MXTensor, padded_offsets_E1: torch.Tensor, block_p: int = 64, block_n: int = 64,
    block_q: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:  # fmt: skip
    """float32 (E, N, Q): out[e] = G_e^T @ X_e over each expert's 32-aligned padded token range."""
    if g.dim != 0 or x.dim != 0:
        raise KernelShapeError("weight-gradient operands must be quantized along tokens (dim=0)")
    for name, t in (("g codes", g.codes), ("g scales", g.scales), ("x codes", x.codes), ("x scales", x.scales)):
        check_dtype(name, t, (torch.uint8,))
        check_rank(name, t, 2, "padded rows x features")
        check_contiguous(name, t)
    num_padded, n = g.codes.shape
    q = x.codes.shape[1]
    check_size("x codes", x.codes, 0, num_padded, "padded rows of g")
    check_multiple("g codes", num_padded, MX_BLOCK, "padded row count")
    check_size("g scales", g.scales, 0, num_padded // MX_BLOCK, "padded rows / 32")
    check_size("x scales", x.scales, 0, num_padded // MX_BLOCK, "padded rows / 32")
    check_offsets("padded_offsets_E1", padded_offsets_E1, int(padded_offsets_E1[-1]))
    if int(padded_offsets_E1[-1]) > num_padded:
        raise KernelShapeError(f"padded offsets end at {int(padded_offsets_E1[-1])} > {num_padded} rows")
    check_same_device(g=g.codes, x=x.codes, offsets=padded_offsets_E1)
    num_experts = padded_offsets_E1.numel() - 1
    out = torch.zeros(num_experts, n, q, dtype=torch.float32, device=g.codes.device)
    if n and q:
        grid = (num_experts, triton.cdiv(n, block_n), triton.cdiv(q, block_q))
        _mxfp8_grouped_wgrad_kernel[grid](
            g.codes, g.scales, x.codes, x.scales, out, padded_offsets_E1.contiguous(), n, q,
            BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_Q=block_q, DOT_BF16=out.is_cuda,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
