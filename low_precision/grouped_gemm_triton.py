"""Triton grouped GEMMs over experts, each kernel beside its launcher.

Hopper (sm_90) has FP8 tensor cores but no FP4 or MX-scaled ones, so:

- NVFP4 forward, out[m] = A[m] @ B[e]^T with per-token A and per-expert B: ``_nvfp4_dequant_kernel``
  expands each operand to bf16, exactly (an E2M1 value times an E4M3 scale has at most 6 significant
  bits), and ``_nvfp4_grouped_mm_kernel`` multiplies them with bf16 MMA and fp32 accumulation, applying
  the per-token x per-expert scale in its epilogue with ``tl.div_rn``.
- MXFP8 input gradients (``_mxfp8_grouped_mm_kernel``, operands quantized along K) and weight gradients
  (``_mxfp8_grouped_wgrad_kernel``, quantized along tokens): the E4M3 codes go to FP8 MMA as they are,
  one 32-wide scale block per dot, and the block's two power-of-two scales multiply the fp32 partial
  product before it joins the accumulator. Products are exact and Hopper's limited-precision FP8
  accumulator (about 14 bits, DeepSeek-V3 report sec. 3.3.2) only ever sums 32 of them.

On CPU tensors (the Triton interpreter, whose float8 casts and bf16 dots are wrong, triton#8322) the same
loops run on values decoded with bit operations, in fp32: the same math, testable in CI. Forward tiles
over rows are mapped to experts by a small tile table built on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from low_precision._checks import (
    check_contiguous,
    check_dtype,
    check_multiple,
    check_offsets,
    check_rank,
    check_same_device,
    check_size,
)
from low_precision._triton_formats import decode_e2m1, decode_e4m3, mx_dequant_multiplier
from low_precision.errors import KernelShapeError
from low_precision.mxfp8 import MX_BLOCK, MXTensor
from low_precision.nvfp4 import NVFP4_BLOCK, NVFP4Tensor

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
def _nvfp4_dequant_kernel(
    packed_ptr, scales_ptr, out_ptr, num_rows, half_k,
    BLOCK_R: tl.constexpr, BLOCK_PAIRS: tl.constexpr, TO_BF16: tl.constexpr,
):  # fmt: skip
    """out[r, 2j], out[r, 2j + 1] = E2M1 low, high nibble of packed[r, j] x E4M3 scale of their block."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.program_id(1) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    mask = (rows < num_rows)[:, None] & (pairs < half_k)[None, :]
    r = rows.to(tl.int64)[:, None]
    codes = tl.load(packed_ptr + r * half_k + pairs[None, :], mask=mask, other=0).to(tl.int32)
    scale = decode_e4m3(tl.load(scales_ptr + r * (half_k // 8) + (pairs // 8)[None, :], mask=mask, other=0))
    lo = decode_e2m1(codes) * scale
    hi = decode_e2m1(codes >> 4) * scale
    if TO_BF16:
        lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    # interleave (lo, hi) along a new last axis: one contiguous store instead of two strided ones
    values = tl.reshape(tl.join(lo, hi), (BLOCK_R, 2 * BLOCK_PAIRS))
    elems = 2 * tl.program_id(1) * BLOCK_PAIRS + tl.arange(0, 2 * BLOCK_PAIRS)
    out_mask = (rows < num_rows)[:, None] & (elems < 2 * half_k)[None, :]
    tl.store(out_ptr + r * (2 * half_k) + elems[None, :], values, mask=out_mask)


def _nvfp4_unscaled(packed: torch.Tensor, scales: torch.Tensor, to_bf16: bool) -> torch.Tensor:
    """(R, K) E2M1 x E4M3 values of (R, K/2) packed codes, without the global scale (exact in bf16)."""
    rows, half_k = packed.shape
    out = torch.empty(rows, 2 * half_k, dtype=torch.bfloat16 if to_bf16 else torch.float32, device=packed.device)
    if rows and half_k:
        block_r, block_pairs = 16, 128
        grid = (triton.cdiv(rows, block_r), triton.cdiv(half_k, block_pairs))
        _nvfp4_dequant_kernel[grid](packed, scales, out, rows, half_k,
                                    BLOCK_R=block_r, BLOCK_PAIRS=block_pairs, TO_BF16=to_bf16)
    return out


@triton.jit
def _output_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (expert, rows, row mask, columns, column mask) and the rows and columns clamped into
    range (int64), which the main loop reads without masks: out-of-range lanes are never stored."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, tl.maximum(end - 1, 0)).to(tl.int64)  # padding tiles (end 0) read row 0
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    return e, rows, rows < end, cols, cols < N, rows_in, cols_in


@triton.jit
def _nvfp4_grouped_mm_kernel(
    a_ptr, a_amax_ptr, b_ptr, b_amax_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """out = (A @ B[e]^T) * (amax_a[m] * amax_b[e] / 2688^2) on unscaled NVFP4 values (bf16 or fp32)."""
    e, rows, row_ok, cols, col_ok, rows_in, cols_in = _output_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, N,
                                                                   BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + (e * N + cols_in)[None, :] * K + offs_k[:, None]  # B^T tile (K, N) read in place
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a, b = tl.load(a_ptrs), tl.load(b_ptrs)
        else:
            k_ok = k0 + offs_k < K
            a, b = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0), tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_amax = tl.load(a_amax_ptr + rows, mask=row_ok, other=0.0)
    b_amax = tl.load(b_amax_ptr + e)
    epilogue = tl.div_rn(a_amax * b_amax, tl.zeros_like(a_amax) + 7225344.0)  # 2688^2
    out_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc * epilogue[:, None], mask=out_mask)


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
    a: NVFP4Tensor, b: NVFP4Tensor, offsets_E1: torch.Tensor, block_m: int = 128, block_n: int = 256,
    block_k: int = 64, num_warps: int = 8, num_stages: int = 3,
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
    num_experts, n = b.packed.shape[0], b.packed.shape[1]
    out = torch.empty(num_rows, n, dtype=torch.float32, device=a.packed.device)
    if num_rows and n:
        on_gpu = out.is_cuda
        a_vals = _nvfp4_unscaled(a.packed, a.block_scales, on_gpu)
        b_vals = _nvfp4_unscaled(b.packed.view(num_experts * n, k // 2), b.block_scales.view(num_experts * n, -1),
                                 on_gpu)
        tiles = _tile_map(offsets_E1, num_rows, block_m)
        grid = (tiles[0].numel(), triton.cdiv(n, block_n))
        _nvfp4_grouped_mm_kernel[grid](
            a_vals, a.global_amax.float().contiguous(), b_vals, b.global_amax.float().contiguous(), out, *tiles,
            n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


@triton.jit
def _mx_values(codes, ON_GPU: tl.constexpr):
    """E4M3 codes as FP8 for the tensor cores (GPU) or as exact fp32 values (interpreter)."""
    if ON_GPU:
        values = codes.to(tl.float8e4nv, bitcast=True)
    else:
        values = decode_e4m3(codes)
    return values


@triton.jit
def _mxfp8_grouped_mm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    e, rows, row_ok, cols, col_ok, rows_in, cols_in = _output_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, N,
                                                                   BLOCK_M, BLOCK_N)
    num_blocks = K // 32
    offs_k = tl.arange(0, 32)
    a_ptrs = a_ptr + rows_in[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + (e * N + cols_in)[None, :] * K + offs_k[:, None]  # B^T tile (32, N) read in place
    sa_ptrs = a_scale_ptr + rows_in * num_blocks
    sb_ptrs = b_scale_ptr + (e * N + cols_in) * num_blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, num_blocks):  # one MX scale block (32 along K) per dot
        part = tl.dot(_mx_values(tl.load(a_ptrs), ON_GPU), _mx_values(tl.load(b_ptrs), ON_GPU))
        # one operand's scale at a time: the product of two scales can pass float32's range (2^100 * 2^40)
        # where the scaled products do not, and 0 * inf is NaN
        scale_a, scale_b = mx_dequant_multiplier(tl.load(sa_ptrs)), mx_dequant_multiplier(tl.load(sb_ptrs))
        acc += (part * scale_a[:, None]) * scale_b[None, :]
        a_ptrs += 32
        b_ptrs += 32
        sa_ptrs += 1
        sb_ptrs += 1
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def triton_mxfp8_grouped_mm(
    a: MXTensor, b: MXTensor, offsets_E1: torch.Tensor, block_m: int = 64, block_n: int = 128,
    num_warps: int = 4, num_stages: int = 3,
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
            BLOCK_M=block_m, BLOCK_N=block_n, ON_GPU=out.is_cuda,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


@triton.jit
def _mxfp8_grouped_wgrad_kernel(
    g_ptr, g_scale_ptr, x_ptr, x_scale_ptr, out_ptr, padded_offsets_ptr, N, Q,
    BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    n_ok = n < N
    q_ok = q < Q
    start = tl.load(padded_offsets_ptr + e)  # multiples of 32: each 32-row block is one scale block
    end = tl.load(padded_offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_Q), dtype=tl.float32)
    for p0 in range(start, end, 32):  # one MX scale block (32 tokens) per dot
        p = (p0 + tl.arange(0, 32)).to(tl.int64)[:, None]
        g = _mx_values(tl.load(g_ptr + p * N + n[None, :], mask=n_ok[None, :], other=0), ON_GPU)
        x = _mx_values(tl.load(x_ptr + p * Q + q[None, :], mask=q_ok[None, :], other=0), ON_GPU)
        pb = (p0 + tl.zeros((1,), dtype=tl.int64)) // 32  # the scale row, in int64
        sg = mx_dequant_multiplier(tl.load(g_scale_ptr + pb * N + n, mask=n_ok, other=0))
        sx = mx_dequant_multiplier(tl.load(x_scale_ptr + pb * Q + q, mask=q_ok, other=0))
        acc += (tl.dot(tl.trans(g), x) * sg[:, None]) * sx[None, :]  # one scale at a time, as above
    out_offs = e.to(tl.int64) * N * Q + n.to(tl.int64)[:, None] * Q + q[None, :]
    tl.store(out_ptr + out_offs, acc, mask=n_ok[:, None] & q_ok[None, :])


def triton_mxfp8_grouped_wgrad(
    g: MXTensor, x: MXTensor, padded_offsets_E1: torch.Tensor, block_n: int = 64, block_q: int = 64,
    num_warps: int = 4, num_stages: int = 3,
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
            BLOCK_N=block_n, BLOCK_Q=block_q, ON_GPU=out.is_cuda,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
