"""MXFP8 reference quantizer (OCP MX v1.0): E4M3 elements, one E8M0 scale per block of 32.

Byte-compatible with torchao ``to_mx`` (FLOOR and RCEIL) including its edge rules:
- FLOOR divides by the scale clamped to the smallest normal float32 (2^-126), so a block with scale
  byte 0 holds x * 2^126; a NaN block holds +-0 for finite elements and NaN otherwise.
- RCEIL multiplies by 2^(127 - e), by 1.0 when e == 0, and by NaN when the block holds a NaN.
- NaN results are written explicitly (0x7F for RCEIL NaN blocks, 0xFF for +-inf in FLOOR NaN blocks)
  so the bytes do not depend on how the hardware propagates NaN payloads.
Dequantization uses the same effective scale, so quantize/dequantize round-trips are consistent.

Quantization runs along rows (the last dim, blocks of 32 consecutive elements) or along columns
(dim 0). For grouped GEMMs that reduce over tokens, :func:`padded_group_layout` places each expert's
rows at a 32-aligned start so no block straddles two experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_dtype, check_multiple, check_rank
from kernels.errors import KernelShapeError
from kernels.formats import (
    E4M3_MAX,
    ScaleMode,
    decode_e4m3,
    e8m0_floor,
    e8m0_rceil,
    encode_e4m3,
    exp2_int,
)

__all__ = [
    "MX_BLOCK",
    "MXTensor",
    "PaddedGroups",
    "mx_scale_multiplier",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_experts",
    "mxfp8_quantize_grouped_cols",
    "padded_group_layout",
]

MX_BLOCK = 32


@dataclass(frozen=True)
class MXTensor:
    """E4M3 codes and E8M0 scales of a tensor quantized along ``dim`` (-1: last dim, 0: columns).

    codes: uint8, same shape as the source. scales: uint8, the source shape with ``dim`` divided by 32.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    dim: int
    mode: ScaleMode


def mx_scale_multiplier(scale_u8: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """The float32 factor each element is multiplied by before E4M3 rounding (NaN for NaN blocks).

    FLOOR: 2^(127 - max(e, 1)), or 0 for e == 255 (x / inf). RCEIL: 2^(127 - e), 1 for e == 0.
    """
    e = scale_u8.to(torch.int32)
    if mode is ScaleMode.FLOOR:
        mult = exp2_int(127 - torch.clamp(e, 1, 254))
        return torch.where(e == 255, 0.0, mult)
    mult = exp2_int(127 - torch.clamp(e, 0, 254))
    mult = torch.where(e == 0, 1.0, mult)
    return torch.where(e == 255, torch.nan, mult)


def _dequant_multiplier(scale_u8: torch.Tensor) -> torch.Tensor:
    e = scale_u8.to(torch.int32)
    mult = exp2_int(torch.clamp(e, 1, 254) - 127)
    return torch.where(e == 255, torch.nan, mult)


def _quantize_rows(x_f32: torch.Tensor, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x_f32.shape
    blocks = x_f32.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True) if blocks.numel() else blocks.new_zeros(*blocks.shape[:2], 1)
    scale = e8m0_floor(amax) if mode is ScaleMode.FLOOR else e8m0_rceil(amax)
    scaled = blocks * mx_scale_multiplier(scale, mode)
    scaled = torch.clamp(scaled, -E4M3_MAX, E4M3_MAX)
    codes = encode_e4m3(scaled)
    if mode is ScaleMode.RCEIL:  # x * NaN: every element of a NaN block is the positive NaN 0x7F
        codes = torch.where(scale == 255, 0x7F, codes)
    else:  # x / inf: +-inf becomes the x86 default NaN (negative), finite x a signed zero
        codes = torch.where((scale == 255) & torch.isinf(blocks), 0xFF, codes)
    return codes.to(torch.uint8).reshape(rows, cols), scale.squeeze(-1)


def mxfp8_quantize(x: torch.Tensor, dim: int = -1, mode: ScaleMode = ScaleMode.RCEIL) -> MXTensor:
    """Quantize a 2-D bf16/fp32 tensor to MXFP8 along ``dim`` (-1 or 1: rows; 0: columns).

    Raises:
        KernelShapeError: not 2-D, or the quantized dim is not a multiple of 32.
        KernelDTypeError: not bf16 / fp32.
    """
    check_dtype("x", x, (torch.bfloat16, torch.float32))
    check_rank("x", x, 2, "rows x cols")
    if dim not in (-1, 0, 1):
        raise KernelShapeError(f"dim must be -1/1 (rows) or 0 (columns); got {dim}")
    along_rows = dim != 0
    src = x if along_rows else x.t()
    check_multiple("x", src.shape[1], MX_BLOCK, f"size of dim {dim}")
    codes, scales = _quantize_rows(src.float().contiguous(), mode)
    if not along_rows:
        codes, scales = codes.t().contiguous(), scales.t().contiguous()
    return MXTensor(codes=codes, scales=scales, dim=-1 if along_rows else 0, mode=mode)


def mxfp8_dequantize(mx: MXTensor) -> torch.Tensor:
    """float32 values represented by an :class:`MXTensor`."""
    values = decode_e4m3(mx.codes)
    mult = _dequant_multiplier(mx.scales)
    mult = mult.repeat_interleave(MX_BLOCK, dim=-1 if mx.dim == -1 else 0)
    return values * mult


def mxfp8_quantize_experts(w_ENK: torch.Tensor, mode: ScaleMode = ScaleMode.RCEIL) -> MXTensor:
    """Quantize expert weights (E, N, K) along K (the reduction dim): codes (E, N, K), scales (E, N, K/32)."""
    check_dtype("w_ENK", w_ENK, (torch.bfloat16, torch.float32))
    check_rank("w_ENK", w_ENK, 3, "experts x out x reduction dim")
    num_experts, rows, cols = w_ENK.shape
    mx = mxfp8_quantize(w_ENK.reshape(num_experts * rows, cols), dim=-1, mode=mode)
    return MXTensor(
        codes=mx.codes.reshape(num_experts, rows, cols),
        scales=mx.scales.reshape(num_experts, rows, cols // MX_BLOCK),
        dim=-1,
        mode=mode,
    )


@dataclass(frozen=True)
class PaddedGroups:
    """Row layout with every group starting at a multiple of 32.

    src_rows_P: for each padded row, the source row it holds, or -1 for padding (int64, length P).
    padded_offsets_E1: group boundaries in the padded layout (int64, E+1).
    """

    src_rows_P: torch.Tensor
    padded_offsets_E1: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.src_rows_P.numel()


def padded_group_layout(offsets_E1: torch.Tensor, num_rows: int) -> PaddedGroups:
    """Place group e's rows [off[e], off[e+1]) at padded rows [poff[e], poff[e] + size_e).

    The padded row count is the fixed bound ceil(M/32)*32 + 32*E, so no host sync is needed.
    """
    offsets = offsets_E1.to(torch.int64)
    sizes = offsets[1:] - offsets[:-1]
    padded_sizes = (sizes + MX_BLOCK - 1) // MX_BLOCK * MX_BLOCK
    poff = torch.zeros_like(offsets)
    poff[1:] = torch.cumsum(padded_sizes, 0)
    num_groups = sizes.numel()
    total = (num_rows + MX_BLOCK - 1) // MX_BLOCK * MX_BLOCK + MX_BLOCK * num_groups
    p = torch.arange(total, device=offsets.device)
    group = torch.clamp(torch.searchsorted(poff, p, right=True) - 1, 0, num_groups - 1)
    within = p - poff[group]
    src = torch.where(within < sizes[group], offsets[group] + within, -1)
    return PaddedGroups(src_rows_P=src, padded_offsets_E1=poff)


def mxfp8_quantize_grouped_cols(
    x_MN: torch.Tensor, layout: PaddedGroups, mode: ScaleMode = ScaleMode.RCEIL
) -> MXTensor:
    """Quantize along dim 0 (tokens) in blocks of 32 that never straddle two groups.

    Returns an :class:`MXTensor` over the padded layout: codes (P, N), scales (P/32, N); padded rows
    hold zeros.
    """
    check_dtype("x_MN", x_MN, (torch.bfloat16, torch.float32))
    check_rank("x_MN", x_MN, 2, "tokens x features")
    src = layout.src_rows_P
    if x_MN.shape[0] == 0:
        padded = torch.zeros(src.numel(), x_MN.shape[1], dtype=torch.float32, device=x_MN.device)
    else:
        gathered = x_MN.float()[torch.clamp(src, min=0)]
        padded = torch.where((src >= 0)[:, None], gathered, 0.0)
    return mxfp8_quantize(padded, dim=0, mode=mode)
