"""NVFP4 reference quantizer with an FP32 per-row (per-token) scale.

Follows TransformerEngine's per-token NVFP4 recipe (block 16, E4M3 block scales, E2M1 elements):

    S_enc   = 2688 / max(row_amax, 1e-12)          (IEEE division; 1 if the result is 0 or inf)
    dec_b   = e4m3(min(amax_b * (S_enc * f32(1/6)), 448))
    enc_b   = S_enc / f32(dec_b)                   (IEEE division; 0 where dec_b == 0)
    code    = e2m1(clamp(x * enc_b, -6, 6))
    x_hat   = code * dec_b * global_amax / 2688

``global_amax`` is the row amax the encode scale was built from (max(row_amax, 1e-12), or 2688 where
S_enc was replaced by 1), so the dequantization inverts the encode scale in every case.

Rows never see each other: quant(x)[i] equals quant(x[i:i+1]) byte for byte (batch invariance).
Weights use one scale per expert (``nvfp4_quantize_experts``): the "row" is the whole expert matrix.

Non-finite values (this project's rule; E2M1 has no NaN or inf and TransformerEngine leaves the case
undefined): a row (token, or expert) holding a NaN or +-inf anywhere quantizes to NaN as a whole, like
an MX block holding one (OCP MX v1.0, low_precision.mxfp8): every block scale is the E4M3 NaN 0x7F, every
code 0, and ``global_amax`` is NaN. It dequantizes to all NaN, and a GEMM's output for that token (or
for every token routed to that expert) is NaN, where the unquantized product is inf or NaN too. Without
the rule an inf became the finite 2688 (S_enc = 2688 / inf = 0, replaced by 1) and the row's other
values 0: a finite output where the model in full precision has none.

Divisions are written tensor / tensor: torch computes ``python_float / tensor`` as a reciprocal
multiply, which is not IEEE and flips some codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from low_precision._checks import check_dtype, check_multiple, check_rank
from low_precision.formats import E4M3_MAX, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, pack_e2m1, unpack_e2m1

__all__ = [
    "NVFP4_BLOCK",
    "NVFP4_GLOBAL",
    "NVFP4Tensor",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "nvfp4_quantize_experts",
    "nvfp4_unscaled_values",
]

NVFP4_BLOCK = 16
NVFP4_GLOBAL = 2688.0  # 448 (E4M3 max) * 6 (E2M1 max)
_AMAX_FLOOR = 1e-12
_E4M3_NAN = 0x7F


@dataclass(frozen=True)
class NVFP4Tensor:
    """Packed E2M1 codes, E4M3 block scales and the float32 global amax of each row (or expert).

    For a source of shape (..., R, K): packed (..., R, K/2) uint8, block_scales (..., R, K/16) uint8,
    global_amax (...,) per expert or (..., R) per row, float32.
    """

    packed: torch.Tensor
    block_scales: torch.Tensor
    global_amax: torch.Tensor


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def encode_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_enc = 2688 / max(amax, 1e-12) (IEEE), 1 where 0 or inf; returns (S_enc, global_amax).

    global_amax is NaN where amax is not finite (the row holds a NaN or inf: the module's rule).
    """
    clamped = torch.clamp(amax.float(), min=_AMAX_FLOOR)
    s_enc = _const(NVFP4_GLOBAL, amax) / clamped
    bad = (s_enc == 0) | torch.isinf(s_enc)
    s_enc = torch.where(bad, 1.0, s_enc)
    global_amax = torch.where(bad, NVFP4_GLOBAL, clamped)
    return s_enc, torch.where(torch.isfinite(amax), global_amax, torch.nan)


def _quantize_blocks(x_f32: torch.Tensor, s_enc: torch.Tensor, row_finite: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x_f32 (R, K), s_enc (R,), row_finite (R,) -> packed (R, K/2), block scales (R, K/16)."""
    rows, cols = x_f32.shape
    blocks = x_f32.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    amax_b = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:2])
    s_dec_mult = s_enc * _const(1.0 / 6.0, x_f32)
    scale_codes = encode_e4m3(torch.clamp(amax_b * s_dec_mult[:, None], max=E4M3_MAX))
    dec = decode_e4m3(scale_codes)
    enc = torch.where(dec == 0, 0.0, s_enc[:, None] / torch.where(dec == 0, 1.0, dec))
    scaled = torch.clamp(blocks * enc[..., None], -6.0, 6.0)
    codes = encode_e2m1(scaled).reshape(rows, cols)
    # a row holding a NaN or inf: all blocks NaN, all codes 0 (the module's rule)
    scale_codes = torch.where(row_finite[:, None], scale_codes, _E4M3_NAN)
    codes = torch.where(row_finite[:, None], codes, 0)
    return pack_e2m1(codes), scale_codes


def _check_input(name: str, x: torch.Tensor, rank: int, legend: str) -> None:
    check_dtype(name, x, (torch.bfloat16, torch.float32))
    check_rank(name, x, rank, legend)
    check_multiple(name, x.shape[-1], NVFP4_BLOCK, "last dim")


def nvfp4_quantize(x_RK: torch.Tensor) -> NVFP4Tensor:
    """Quantize each row of a 2-D bf16/fp32 tensor with its own FP32 scale (per-token NVFP4).

    Raises:
        KernelShapeError: not 2-D or the last dim is not a multiple of 16.
        KernelDTypeError: not bf16 / fp32.
    """
    _check_input("x_RK", x_RK, 2, "rows x reduction dim")
    x = x_RK.float()
    amax = x.abs().amax(dim=-1) if x.shape[1] else x.new_zeros(x.shape[0])  # NaN when the row holds one
    s_enc, global_amax = encode_scale(amax)
    packed, scales = _quantize_blocks(x, s_enc, torch.isfinite(amax))
    return NVFP4Tensor(packed=packed, block_scales=scales, global_amax=global_amax)


def nvfp4_quantize_experts(w_ENK: torch.Tensor) -> NVFP4Tensor:
    """Quantize expert weights (E, N, K) along K with one FP32 scale per expert."""
    _check_input("w_ENK", w_ENK, 3, "experts x out x reduction dim")
    num_experts, rows, cols = w_ENK.shape
    w = w_ENK.float()
    amax = w.abs().amax(dim=(1, 2)) if w.numel() else w.new_zeros(num_experts)
    s_enc, global_amax = encode_scale(amax)
    packed, scales = _quantize_blocks(w.reshape(num_experts * rows, cols), s_enc.repeat_interleave(rows),
                                      torch.isfinite(amax).repeat_interleave(rows))
    return NVFP4Tensor(
        packed=packed.reshape(num_experts, rows, cols // 2),
        block_scales=scales.reshape(num_experts, rows, cols // NVFP4_BLOCK),
        global_amax=global_amax,
    )


def nvfp4_unscaled_values(q: NVFP4Tensor) -> torch.Tensor:
    """code * dec_b as float32 (exact): the values a GEMM multiplies before the global-scale epilogue."""
    values = decode_e2m1(unpack_e2m1(q.packed))
    dec = decode_e4m3(q.block_scales).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return values * dec


def nvfp4_dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """float32 values: code * dec_b * global_amax / 2688 (per row, or per expert for 3-D)."""
    unscaled = nvfp4_unscaled_values(q)
    ga = q.global_amax
    ga = ga[:, None] if unscaled.dim() == 2 else ga[:, None, None]
    return unscaled * (ga / _const(NVFP4_GLOBAL, ga))
