"""The torch MXFP8 reference against torchao ``to_mx`` (byte for byte) and its own invariants."""

from __future__ import annotations

import pytest
import torch
from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

from kernels.errors import KernelDTypeError, KernelShapeError
from kernels.formats import ScaleMode
from kernels.mxfp8 import (
    mxfp8_dequantize,
    mxfp8_quantize,
    mxfp8_quantize_grouped_cols,
    padded_group_layout,
)
from tests.kernels._helpers import all_bf16_values, edge_values, sqnr_db

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
    scale, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32, TORCHAO_MODE[mode])
    ours = mxfp8_quantize(x, dim=-1, mode=mode)
    assert torch.equal(ours.scales, scale.view(torch.uint8))
    assert torch.equal(ours.codes, data.view(torch.uint8))


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
