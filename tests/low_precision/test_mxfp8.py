"""The torch MXFP8 reference against torchao ``to_mx`` (byte for byte on ordinary blocks), its OCP rules
where torchao departs from the specification (non-finite blocks, scale byte 0, RCEIL's top scale), and
its own invariants."""

from __future__ import annotations

import pytest
import torch
from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

from low_precision.errors import KernelDTypeError, KernelShapeError
from low_precision.formats import ScaleMode, decode_e4m3, encode_e4m3
from low_precision.mxfp8 import (
    MXTensor,
    mxfp8_dequantize,
    mxfp8_quantize,
    mxfp8_quantize_grouped_cols,
    padded_group_layout,
)
from tests.low_precision._helpers import all_bf16_values, edge_values, sqnr_db

TORCHAO_MODE = {ScaleMode.FLOOR: ScaleCalculationMode.FLOOR, ScaleMode.RCEIL: ScaleCalculationMode.RCEIL}


def _inputs(kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    if kind == "random":
        x = torch.randn(128, 256, generator=g)
    elif kind == "heavy_tailed":  # Cauchy elements (ratio of normals), log-normal row scales
        x = torch.randn(128, 256, generator=g) / torch.randn(128, 256, generator=g)
        x = x * torch.exp(torch.randn(128, 1, generator=g) * 8)
    elif kind == "edge":
        x = edge_values(torch.float32)
    else:
        raise AssertionError(kind)
    return x.to(dtype)


def _assert_equal_to_torchao(x: torch.Tensor, mode: ScaleMode) -> None:
    """Byte for byte equal where torchao follows OCP (scales 1..246 of finite blocks); NaN blocks where
    the block holds a NaN or an infinity; the documented departures elsewhere (checked below)."""
    scale, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32, TORCHAO_MODE[mode])
    theirs_scales, theirs_codes = scale.view(torch.uint8).reshape(-1), data.view(torch.uint8).reshape(-1, 32)
    ours = mxfp8_quantize(x, dim=-1, mode=mode)
    scales, codes = ours.scales.reshape(-1), ours.codes.reshape(-1, 32)
    finite = torch.isfinite(x.float().reshape(-1, 32)).all(dim=1)
    ordinary = finite & (theirs_scales >= 1) & (theirs_scales <= 246)
    assert torch.equal(scales[ordinary], theirs_scales[ordinary])
    assert torch.equal(codes[ordinary], theirs_codes[ordinary])
    assert bool((scales[~finite] == 255).all()) and bool((codes[~finite] == 0x7F).all())
    assert bool(torch.isfinite(mxfp8_dequantize(ours).reshape(-1, 32)[finite]).all())


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "heavy_tailed", "edge"])
def test_equals_torchao_to_mx(kind: str, dtype: torch.dtype, mode: ScaleMode) -> None:
    _assert_equal_to_torchao(_inputs(kind, dtype), mode)


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_torchao_on_all_65536_bf16_values(dtype: torch.dtype, mode: ScaleMode) -> None:
    values = all_bf16_values()
    # each value alone in its block (amax = the value) and all values packed 32 per block
    alone = torch.zeros(values.numel(), 32, dtype=torch.bfloat16)
    alone[:, 0] = values.flatten()
    alone[:, 1:] = values.flatten()[:, None] * 0.5
    for x in (values, alone):
        _assert_equal_to_torchao(x.to(dtype), mode)


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_column_quantization_is_row_quantization_of_the_transpose(mode: ScaleMode) -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    cols = mxfp8_quantize(x, dim=0, mode=mode)
    rows = mxfp8_quantize(x.t().contiguous(), dim=-1, mode=mode)
    assert torch.equal(cols.codes, rows.codes.t())
    assert torch.equal(cols.scales, rows.scales.t())
    assert torch.equal(mxfp8_dequantize(cols), mxfp8_dequantize(rows).t())


@pytest.mark.parametrize(("mode", "expected_db"), [(ScaleMode.FLOOR, 30.7), (ScaleMode.RCEIL, 31.5)])
def test_sqnr_matches_published_figures(mode: ScaleMode, expected_db: float) -> None:
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(4)).bfloat16()
    db = sqnr_db(x, mxfp8_dequantize(mxfp8_quantize(x, mode=mode)))
    assert abs(db - expected_db) < 0.4, db


def test_dequantize_matches_torchao_values() -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) * 1e-3
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    expected = data.float().reshape(16, 2, 32) * torch.pow(2.0, scale.view(torch.uint8).float() - 127)[..., None]
    assert torch.equal(mxfp8_dequantize(mxfp8_quantize(x)), expected.reshape(16, 64))


def test_padded_group_layout_aligns_every_group() -> None:
    offsets = torch.tensor([0, 5, 5, 70, 101])  # sizes 5, 0, 65, 31
    layout = padded_group_layout(offsets, 101)
    assert layout.padded_offsets_E1.tolist() == [0, 32, 32, 128, 160]
    assert layout.num_rows == 128 + 32 * 4
    src = layout.src_rows_P
    assert src[:5].tolist() == list(range(5)) and bool((src[5:32] == -1).all())
    assert src[32:97].tolist() == list(range(5, 70)) and bool((src[97:128] == -1).all())
    assert src[128:159].tolist() == list(range(70, 101)) and bool((src[159:] == -1).all())


def test_grouped_columns_never_mix_groups() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 64, generator=g)
    x[:8] *= 1e4  # a loud first group must not change the second group's scales
    offsets = torch.tensor([0, 8, 40])
    layout = padded_group_layout(offsets, 40)
    mx = mxfp8_quantize_grouped_cols(x, layout)
    alone = mxfp8_quantize(x[8:].contiguous(), dim=0)
    assert torch.equal(mx.codes[32:64], alone.codes)
    assert torch.equal(mx.scales[1], alone.scales[0])
    deq = mxfp8_dequantize(mx)
    assert bool((deq[layout.src_rows_P < 0] == 0).all())


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(KernelShapeError, match="multiple of 32"):
        mxfp8_quantize(torch.randn(4, 48))
    with pytest.raises(KernelShapeError, match="2-D"):
        mxfp8_quantize(torch.randn(2, 4, 32))
    with pytest.raises(KernelDTypeError, match="float16"):
        mxfp8_quantize(torch.randn(4, 32).half())
    with pytest.raises(KernelShapeError, match="dim"):
        mxfp8_quantize(torch.randn(32, 32), dim=2)


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
def test_a_block_with_a_nan_or_an_infinity_is_all_nan(mode: ScaleMode, poison: float) -> None:
    # OCP MX v1.0: the block's scale is NaN, so is every element (torchao gives +-inf a finite scale:
    # FLOOR 247, RCEIL 254, and the other 31 values decode to 0).
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    x[1, 40] = poison
    for mx in (mxfp8_quantize(x, mode=mode), mxfp8_quantize(x.t().contiguous(), dim=0, mode=mode)):
        deq = mxfp8_dequantize(mx)
        deq = deq if mx.dim == -1 else deq.t()
        assert bool(deq[1, 32:].isnan().all()) and bool(torch.isfinite(deq[1, :32]).all())
        assert bool(torch.isfinite(deq[[0, 2]]).all())
    scale, _ = to_mx(x, torch.float8_e4m3fn, 32, TORCHAO_MODE[mode])
    expected_torchao = 255 if poison != poison else {ScaleMode.FLOOR: 247, ScaleMode.RCEIL: 254}[mode]
    assert int(scale.view(torch.uint8)[1, 1]) == expected_torchao  # the departure, stated


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_scale_byte_zero_means_two_to_the_minus_127(mode: ScaleMode) -> None:
    # Tiny blocks (float32 subnormals included) get scale 0 = 2^-127 as OCP decodes it: the elements are
    # x * 2^127 rounded to E4M3 and an outside reader multiplying by 2^-127 gets the right values.
    values = torch.tensor([2.0**-130, -(2.0**-128), 1e-40, -3e-39, 2.0**-149, 0.0, 2.0**-125, 1.5 * 2.0**-124])
    x = values.repeat(4)[None, :]
    mx = mxfp8_quantize(x, mode=mode)
    assert mx.scales.tolist() == [[0]]
    expected = encode_e4m3(torch.clamp(x * 2.0**127, -448, 448))
    assert torch.equal(mx.codes, expected)
    outside_reader = decode_e4m3(mx.codes).double() * 2.0**-127  # OCP decode, in float64
    assert torch.equal(mxfp8_dequantize(mx).double(), outside_reader)
    # E4M3's rounding error: half a unit in the last of 3 mantissa bits, or half a subnormal step
    assert bool(((outside_reader - x.double()).abs() <= x.double().abs() * 2.0**-4 + 2.0**-137).all())
    # torchao stores x * 2^126 (FLOOR) or x unscaled (RCEIL) under the same byte
    _, data = to_mx(x, torch.float8_e4m3fn, 32, TORCHAO_MODE[mode])
    assert not torch.equal(data.view(torch.uint8), mx.codes)


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_finite_extremes_dequantize_to_finite_values(mode: ScaleMode) -> None:
    # RCEIL puts amax > 448 * 2^119 at scale 247 (2^120), where E4M3's 256 would be 2^128 = inf in
    # float32: the elements saturate at 240 there (torchao dequantizes 3.39e38 to inf).
    top = torch.finfo(torch.float32).max
    x = torch.tensor([[top, -top, 3.39e38, 3.0e38, 2.99e38, 1.0] + [0.5] * 26])
    mx = mxfp8_quantize(x, mode=mode)
    deq = mxfp8_dequantize(mx)
    assert bool(torch.isfinite(deq).all())
    assert int(mx.scales) == (247 if mode is ScaleMode.RCEIL else 246)
    assert float(deq[0, 0]) == (240 * 2.0**120 if mode is ScaleMode.RCEIL else 448 * 2.0**119)
    if mode is ScaleMode.RCEIL:
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, TORCHAO_MODE[mode])
        theirs = data.float()[0, 0].double() * 2.0 ** (int(scale.view(torch.uint8)) - 127)
        assert theirs > top  # torchao's value does not fit a float32
    bf16 = mxfp8_dequantize(mxfp8_quantize(torch.full((1, 32), 3.38e38).bfloat16(), mode=mode))
    assert bool(torch.isfinite(bf16).all())


def test_dequantize_follows_the_scale_byte_for_every_byte() -> None:
    codes = torch.full((256, 32), 0x38, dtype=torch.uint8)  # E4M3 1.0
    mx = MXTensor(codes=codes, scales=torch.arange(256, dtype=torch.uint8)[:, None], dim=-1, mode=ScaleMode.RCEIL)
    deq = mxfp8_dequantize(mx)[:, 0]
    expected = torch.pow(torch.tensor(2.0, dtype=torch.float64), torch.arange(256).double() - 127).float()
    assert torch.equal(deq[:255], expected[:255]) and bool(deq[255].isnan())
