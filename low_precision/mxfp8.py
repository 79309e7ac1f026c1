"""MXFP8 reference quantizer (OCP MX v1.0): E4M3 elements, one E8M0 scale per block of 32.

One rule per case, the OCP MX v1.0 specification's (section 5.3-6.3), for both scale modes:
- scale byte e in [0, 254] means 2^(e - 127); the elements are x * 2^(127 - e) rounded to E4M3 (RNE,
  saturating) and dequantize to code * 2^(e - 127). Byte 0 is 2^-127 as OCP decodes it: its block holds
  x * 2^127 (exact; 2^127 is a normal float32) and dequantizes through the subnormal 2^-127.
- a block holding a NaN or +-inf gets the NaN scale 255 and every element the E4M3 NaN 0x7F: it
  dequantizes to 32 NaNs (OCP: a NaN scale makes the whole block NaN; an infinity has no E4M3 code).
- subnormal float32/bf16 inputs are ordinary finite values (FLOOR takes their exponent bits, 0, and
  scale 0 holds them exactly scaled by 2^127).
- a finite input always dequantizes to a finite value: where a block's scale is 2^120 (RCEIL scale 247,
  reached only when amax > 448 * 2^119 ~ 2.98e38) the elements saturate at 240, since 256 * 2^120 is
  past float32's maximum (FLOOR's scales stop at 246, where 448 is finite).

Against torchao ``to_mx`` (0.18): byte for byte equal for every block whose scale is in [1, 246] (every
block of finite values with amax between ~2^-117 and ~2.98e38), the blocks ordinary data lives in. It
differs, on purpose, where torchao departs from the specification: an infinite amax gets a finite scale
there (FLOOR 247, RCEIL 254; the inf decodes to 448 * 2^120 and the other values to 0); FLOOR's byte 0
stores x * 2^126 (a reader following OCP is off by 2x) and RCEIL's byte 0 stores x unscaled; RCEIL's
scale-247 blocks dequantize to inf for finite inputs above ~3.3e38. Tests check the agreement and each
departure.

Quantization runs along rows (the last dim, blocks of 32 consecutive elements) or along columns
(dim 0). For grouped GEMMs that reduce over tokens, :func:`padded_group_layout` places each expert's
rows at a 32-aligned start so no block straddles two experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from low_precision._checks import check_dtype, check_multiple, check_rank
from low_precision.errors import KernelShapeError
from low_precision.formats import (
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
    "mx_element_limit",
    "mx_scale_multiplier",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_experts",
    "mxfp8_quantize_grouped_cols",
    "padded_group_layout",
]

MX_BLOCK = 32
_E4M3_NAN = 0x7F
_SATURATED_SCALE = 247  # 2^120: 256 * 2^120 = 2^128 overflows float32, 240 * 2^120 does not
_SATURATED_LIMIT = 240.0


@dataclass(frozen=True)
class MXTensor:
    """E4M3 codes and E8M0 scales of a tensor quantized along ``dim`` (-1: last dim, 0: columns).

    codes: uint8, same shape as the source. scales: uint8, the source shape with ``dim`` divided by 32.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    dim: int
    mode: ScaleMode


def mx_scale_multiplier(scale_u8: torch.Tensor) -> torch.Tensor:
    """The float32 factor 2^(127 - e) each element is multiplied by before E4M3 rounding (NaN for e = 255),
    the same in both scale modes."""
    e = scale_u8.to(torch.int32)
    return torch.where(e == 255, torch.nan, exp2_int(127 - torch.clamp(e, 0, 254)))


def mx_element_limit(scale_u8: torch.Tensor) -> torch.Tensor:
    """The largest E4M3 magnitude a block with scale e may hold so that code * 2^(e - 127) stays finite."""
    return torch.where(scale_u8.to(torch.int32) >= _SATURATED_SCALE, _SATURATED_LIMIT, E4M3_MAX)


def _dequant_multiplier(scale_u8: torch.Tensor) -> torch.Tensor:
    e = scale_u8.to(torch.int32)
    mult = exp2_int(torch.clamp(e, 0, 254) - 127)
    return torch.where(e == 255, torch.nan, mult)


def _quantize_rows(x_f32: torch.Tensor, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x_f32.shape
    blocks = x_f32.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True) if blocks.numel() else blocks.new_zeros(*blocks.shape[:2], 1)
    scale = e8m0_floor(amax) if mode is ScaleMode.FLOOR else e8m0_rceil(amax)
    limit = mx_element_limit(scale)
    scaled = torch.maximum(torch.minimum(blocks * mx_scale_multiplier(scale), limit), -limit)
    codes = torch.where(scale == 255, _E4M3_NAN, encode_e4m3(scaled).to(torch.int32))
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
