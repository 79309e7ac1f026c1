"""Element and scale formats in pure torch, with integer bit operations wherever rounding matters.

Formats (OCP MX v1.0 and NVIDIA NVFP4):
- E4M3 (``float8_e4m3fn``): bias 7, no infinities, 0x7F/0xFF are NaN, max 448, subnormal step 2^-9.
- E2M1 (FP4): codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign; two codes per byte with the
  even element in the low nibble.
- E8M0: a biased power-of-two exponent byte; 255 is NaN.

All encoders take float32 tensors and return uint8 codes; they never call ``.to(float8_*)`` so the same
arithmetic can be written in Triton (whose interpreter mis-casts fp8, triton#8322).
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "ScaleMode",
    "decode_e2m1",
    "decode_e4m3",
    "e8m0_floor",
    "e8m0_rceil",
    "encode_e2m1",
    "encode_e4m3",
    "exp2_int",
    "pack_e2m1",
    "unpack_e2m1",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_F32_MANT_MASK = 0x7FFFFF
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class ScaleMode(enum.Enum):
    """How an MX block's E8M0 exponent is derived from the block's absolute maximum."""

    FLOOR = "floor"  # OCP spec: floor(log2(amax)) - emax(E4M3)
    RCEIL = "rceil"  # cuBLAS / PTX cvt.rp: ceil(log2(amax / 448))


def _bits(x_f32: torch.Tensor) -> torch.Tensor:
    if x_f32.dtype != torch.float32:
        raise TypeError(f"expected float32, got {x_f32.dtype}")
    return x_f32.contiguous().view(torch.int32)


def _rne_shift(m: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even of ``m / 2**shift`` for non-negative int32 ``m`` and shift in [1, 31]."""
    q = torch.bitwise_right_shift(m, shift)
    rem = m - torch.bitwise_left_shift(q, shift)
    half = torch.bitwise_left_shift(torch.ones_like(m), shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + round_up.to(torch.int32)


def encode_e4m3(x_f32: torch.Tensor) -> torch.Tensor:
    """Round float32 to E4M3 codes (RNE, saturating at +-448, NaN -> 0x7F with the input's sign).

    Infinities saturate to +-448 like torch's ``.to(torch.float8_e4m3fn)``.
    """
    bits = _bits(x_f32)
    sign = torch.bitwise_right_shift(bits, 24) & 0x80  # bit 31 -> bit 7 (arithmetic shift, masked)
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    exp = torch.bitwise_right_shift(mag, 23)
    # Normal E4M3 (|x| >= 2^-6, exponent field >= 121): drop 20 mantissa bits with RNE, rebias 127 -> 7.
    normal = _rne_shift(mag, torch.full_like(mag, 20)) - (120 << 3)
    # Subnormal E4M3 (|x| < 2^-6): round |x| / 2^-9 to an integer in [0, 8].
    mant = (mag & _F32_MANT_MASK) | torch.where(exp > 0, 1 << 23, 0)
    shift = torch.clamp(14 - torch.where(exp > 0, exp, 1) + 127, 1, 31)
    sub = _rne_shift(mant, shift)
    code = torch.where(exp >= 121, normal, sub)
    code = torch.clamp(code, max=0x7E)  # saturate finite values and infinities at 448
    code = torch.where(is_nan, 0x7F, code)
    return (code | sign).to(torch.uint8)


def decode_e4m3(code_u8: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) to float32, exactly."""
    c = code_u8.to(torch.int32)
    exp = torch.bitwise_right_shift(c, 3) & 0xF
    mant = c & 0x7
    normal = torch.bitwise_left_shift(exp + 120, 23) | torch.bitwise_left_shift(mant, 20)
    value = torch.where(exp > 0, normal.view(torch.float32), mant.to(torch.float32) * 2.0**-9)
    value = torch.where((c & 0x7F) == 0x7F, torch.nan, value)
    return torch.where((c & 0x80) != 0, -value, value)


def encode_e2m1(x_f32: torch.Tensor) -> torch.Tensor:
    """Round float32 to E2M1 codes (RNE on the FP4 grid, saturating at +-6); one code per uint8.

    Comparisons against the exact midpoints are exact, so no arithmetic rounding is involved.
    NaN maps to +-0.
    """
    bits = _bits(x_f32)
    a = x_f32.abs()
    code = (a > 0.25).to(torch.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    sign = torch.bitwise_right_shift(bits, 28) & 0x8
    return (code | sign).to(torch.uint8)


def decode_e2m1(code_u8: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (one per uint8, low nibble) to float32."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=code_u8.device)
    c = code_u8.to(torch.int64)
    value = table[c & 0x7]
    return torch.where((c & 0x8) != 0, -value, value)


def pack_e2m1(codes_u8: torch.Tensor) -> torch.Tensor:
    """Pack codes along the last dim, two per byte: element 2j in the low nibble, 2j+1 in the high."""
    if codes_u8.shape[-1] % 2 != 0:
        raise ValueError(f"last dim must be even to pack FP4 pairs; got shape {tuple(codes_u8.shape)}")
    pairs = codes_u8.reshape(*codes_u8.shape[:-1], codes_u8.shape[-1] // 2, 2)
    return pairs[..., 0] | torch.bitwise_left_shift(pairs[..., 1], 4)


def unpack_e2m1(packed_u8: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: one code per uint8, last dim doubled."""
    lo = packed_u8 & 0xF
    hi = torch.bitwise_right_shift(packed_u8, 4)
    return torch.stack([lo, hi], dim=-1).reshape(*packed_u8.shape[:-1], packed_u8.shape[-1] * 2)


def e8m0_floor(amax_f32: torch.Tensor) -> torch.Tensor:
    """FLOOR E8M0 exponent for E4M3 elements: clamp(exponent_bits(amax) - 8, 0, 254); 255 (NaN) when amax
    is NaN or +-inf (OCP MX v1.0: a block holding a NaN or an infinity has a NaN scale).

    Equals torchao ``to_mx`` FLOOR for every finite amax; torchao gives an infinite amax 247.
    """
    exp = torch.bitwise_right_shift(_bits(amax_f32), 23) & 0xFF
    e = torch.clamp(exp - 8, 0, 254)
    return torch.where(torch.isfinite(amax_f32), e, 255).to(torch.uint8)


def e8m0_rceil(amax_f32: torch.Tensor) -> torch.Tensor:
    """RCEIL E8M0 exponent: ceil(log2(amax / 448)) + 127, computed exactly on the bits of the quotient.

    amax / 448 is an IEEE float32 division. Clamped to [0, 254]; a subnormal quotient gives 1 when it
    exceeds 2^-127 and 0 otherwise; a NaN or infinite amax gives 255 (OCP; torchao gives inf 254).
    """
    d = amax_f32 / torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax_f32.device)
    bits = _bits(d)
    exp = torch.bitwise_right_shift(bits, 23) & 0xFF
    mant = bits & _F32_MANT_MASK
    normal = exp + (mant != 0).to(torch.int32)
    sub = (mant > (1 << 22)).to(torch.int32)
    e = torch.clamp(torch.where(exp > 0, normal, sub), 0, 254)
    return torch.where(torch.isfinite(amax_f32), e, 255).to(torch.uint8)


def exp2_int(p: torch.Tensor) -> torch.Tensor:
    """2**p as float32 for integer p in [-149, 127], built from bits (exact, subnormals included)."""
    p = p.to(torch.int32)
    normal = torch.bitwise_left_shift(torch.clamp(p + 127, 1, 254), 23)
    sub = torch.bitwise_left_shift(torch.ones_like(p), torch.clamp(p + 149, 0, 22))
    return torch.where(p >= -126, normal, sub).view(torch.float32)
