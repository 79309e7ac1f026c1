"""Triton device functions for the low-precision formats, written with integer bit operations.

They mirror :mod:`low_precision.formats` and :mod:`low_precision.mxfp8` operation for operation. No float8 casts
(the interpreter's are wrong, triton#8322) and no division operator: quotients use ``tl.div_rn``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INF = tl.constexpr(float("inf"))
# No NaN constant: triton's compiler checks that a global keeps its value between kernels by `!=`, and
# NaN != NaN. `quiet_nan` makes one from bits instead.


def as_loadable(x: torch.Tensor) -> torch.Tensor:
    """Host side of :func:`load_f32`: bf16 tensors go to the kernels as their int16 bits."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load float32 or bf16 (passed as int16 bits) as float32; bf16 is widened by a 16-bit shift,
    exact for every value including subnormals (the interpreter's bf16 conversion loses those)."""
    if IS_BF16:  # both branches assign one name: the compiler type-checks code after an early return
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        value = (bits << 16).to(tl.float32, bitcast=True)
    else:
        value = tl.load(ptr + offs, mask=mask, other=0.0)
    return value


@triton.jit
def quiet_nan(like):
    """A float32 quiet NaN shaped like ``like``."""
    return tl.full(like.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def rne_shift(m, shift):
    """Round-to-nearest-even of m / 2**shift for non-negative int32 m, shift in [1, 31]."""
    q = m >> shift
    rem = m - (q << shift)
    half = (m * 0 + 1) << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def encode_e4m3(x):
    """float32 -> E4M3 code in an int32 (RNE, saturating at +-448, NaN -> 0x7F | sign)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    normal = rne_shift(mag, 20) - (120 << 3)
    mant = (mag & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
    shift = tl.minimum(tl.maximum(141 - tl.maximum(exp, 1), 1), 31)
    sub = rne_shift(mant, shift)
    code = tl.where(exp >= 121, normal, sub)
    code = tl.minimum(code, 0x7E)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def decode_e4m3(code):
    """E4M3 code (any integer dtype) -> float32, exactly."""
    c = code.to(tl.int32) & 0xFF
    exp = (c >> 3) & 0xF
    mant = c & 0x7
    normal = (((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exp > 0, normal, mant.to(tl.float32) * 0.001953125)
    value = tl.where((c & 0x7F) == 0x7F, quiet_nan(value), value)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def encode_e2m1(x):
    """float32 -> E2M1 code (0..15) in an int32 by exact comparisons with the FP4 midpoints."""
    a = tl.abs(x)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 0x8
    return code | sign


@triton.jit
def decode_e2m1(code):
    """E2M1 code (low nibble of an integer) -> float32, exactly."""
    c = code.to(tl.int32) & 0xF
    e = (c >> 1) & 0x3
    m = c & 0x1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    value = tl.where(e > 0, normal, m.to(tl.float32) * 0.5)
    return tl.where((c & 0x8) != 0, -value, value)


@triton.jit
def exp2_int(p):
    """2**p as float32 for integer p in [-149, 127] (exact, subnormals included)."""
    normal = tl.minimum(tl.maximum(p + 127, 1), 254) << 23
    sub = (p * 0 + 1) << tl.minimum(tl.maximum(p + 149, 0), 22)
    return tl.where(p >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_scale(amax, IS_RCEIL: tl.constexpr):
    """E8M0 exponent (int32) of a block amax (float32, NaN if the block holds a NaN): 255 for NaN or inf."""
    if IS_RCEIL:
        d = tl.div_rn(amax, tl.zeros_like(amax) + 448.0)
        bits = d.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        normal = exp + (mant != 0).to(tl.int32)
        sub = (mant > 0x400000).to(tl.int32)
        e = tl.minimum(tl.maximum(tl.where(exp > 0, normal, sub), 0), 254)
    else:
        exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.minimum(tl.maximum(exp - 8, 0), 254)
    return tl.where((amax != amax) | (amax == INF), 255, e)


@triton.jit
def mx_encode(x, e):
    """E4M3 codes of x in a block with exponent e (mirrors mxfp8._quantize_rows): x * 2^(127 - e)
    saturated at 448 (240 where e >= 247), and 0x7F for every element of a NaN block (e = 255)."""
    mult = exp2_int(127 - tl.minimum(e, 254))
    limit = tl.where(e >= 247, 240.0, 448.0)
    codes = encode_e4m3(tl.minimum(tl.maximum(x * mult, -limit), limit))
    return tl.where(e == 255, 0x7F, codes)


@triton.jit
def mx_dequant_multiplier(e):
    """2^(e - 127) as float32 (2^-127 for e = 0, a subnormal); NaN for the NaN scale 255."""
    e = e.to(tl.int32) & 0xFF
    mult = exp2_int(tl.minimum(e, 254) - 127)
    return tl.where(e == 255, quiet_nan(mult), mult)


@triton.jit
def nan_aware_amax(x, axis: tl.constexpr):
    """max |x| along ``axis`` that is NaN when any element is NaN (hardware max drops NaNs)."""
    amax = tl.max(tl.abs(x), axis=axis, keep_dims=True)
    has_nan = tl.max((x != x).to(tl.int32), axis=axis, keep_dims=True)
    return tl.where(has_nan > 0, quiet_nan(amax), amax)
