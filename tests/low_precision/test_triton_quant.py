"""Triton quantizers (TRITON_INTERPRET=1, see conftest) equal the torch reference byte for byte."""

from __future__ import annotations

import pytest
import torch

from low_precision import mxfp8, mxfp8_triton, nvfp4, nvfp4_triton
from low_precision.errors import KernelDTypeError, KernelShapeError, KernelStrideError
from low_precision.formats import ScaleMode
from tests.low_precision._helpers import all_bf16_values, edge_values, mixed_values


def _assert_mx_equal(a: mxfp8.MXTensor, b: mxfp8.MXTensor) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_rows_match_reference(dtype: torch.dtype, mode: ScaleMode) -> None:
    x = torch.cat([mixed_values(37, 64, 0), edge_values(torch.float32).repeat(1, 2)]).to(dtype)
    if dtype == torch.bfloat16:  # torch canonicalises -NaN when widening bf16; keep NaNs positive
        x = torch.where(torch.isnan(x), float("nan"), x)
    _assert_mx_equal(mxfp8.mxfp8_quantize(x, mode=mode), mxfp8_triton.triton_mxfp8_quantize_rows(x, mode))


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_mxfp8_rows_match_reference_on_all_bf16_values(mode: ScaleMode) -> None:
    x = all_bf16_values().reshape(-1, 256)
    x = torch.where(torch.isnan(x), float("nan"), x)
    ours = mxfp8_triton.triton_mxfp8_quantize_rows(x, mode, block_m=64)
    _assert_mx_equal(mxfp8.mxfp8_quantize(x, mode=mode), ours)


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_mxfp8_grouped_columns_match_reference(mode: ScaleMode) -> None:
    x = mixed_values(75, 48, 1)
    offsets = torch.tensor([0, 0, 33, 33, 40, 75])  # empty, ragged and short groups
    layout = mxfp8.padded_group_layout(offsets, 75)
    ref = mxfp8.mxfp8_quantize_grouped_cols(x, layout, mode)
    _assert_mx_equal(ref, mxfp8_triton.triton_mxfp8_quantize_grouped_cols(x, layout, mode))
    xb = x.bfloat16()
    ref_b = mxfp8.mxfp8_quantize_grouped_cols(xb, layout, mode)
    _assert_mx_equal(ref_b, mxfp8_triton.triton_mxfp8_quantize_grouped_cols(xb, layout, mode))


def test_mxfp8_expert_weights_match_reference() -> None:
    w = mixed_values(3 * 24, 64, 2).reshape(3, 24, 64).bfloat16()
    _assert_mx_equal(mxfp8.mxfp8_quantize_experts(w), mxfp8_triton.triton_mxfp8_quantize_experts(w))


def _assert_nv_equal(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.block_scales, b.block_scales)
    nan = a.global_amax.isnan()
    assert torch.equal(nan, b.global_amax.isnan())  # NaN where the row holds a NaN or an inf
    assert torch.equal(a.global_amax[~nan], b.global_amax[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_rows_match_reference(dtype: torch.dtype) -> None:
    x = mixed_values(45, 96, 3) * torch.logspace(-10, 10, 45)[:, None]
    x[0] = 0.0
    x[1, :16] = 0.0
    x[2] = 1e-14
    x = x.to(dtype)
    _assert_nv_equal(nvfp4.nvfp4_quantize(x), nvfp4_triton.triton_nvfp4_quantize(x))


def test_nvfp4_expert_weights_match_reference() -> None:
    w = mixed_values(4 * 20, 64, 4).reshape(4, 20, 64)
    w[2] = 0.0
    w[3] *= 1e-3
    _assert_nv_equal(nvfp4.nvfp4_quantize_experts(w), nvfp4_triton.triton_nvfp4_quantize_experts(w))


def test_triton_nvfp4_is_batch_invariant() -> None:
    x = mixed_values(24, 64, 5).bfloat16()
    full = nvfp4_triton.triton_nvfp4_quantize(x)
    for i in (0, 7, 23):
        alone = nvfp4_triton.triton_nvfp4_quantize(x[i : i + 1].contiguous())
        assert torch.equal(alone.packed, full.packed[i : i + 1])
        assert torch.equal(alone.block_scales, full.block_scales[i : i + 1])


def test_launchers_reject_bad_inputs() -> None:
    with pytest.raises(KernelStrideError, match="contiguous"):
        mxfp8_triton.triton_mxfp8_quantize_rows(torch.randn(64, 32).t())
    with pytest.raises(KernelShapeError, match="multiple of 32"):
        mxfp8_triton.triton_mxfp8_quantize_rows(torch.randn(4, 40))
    with pytest.raises(KernelDTypeError, match="float16"):
        nvfp4_triton.triton_nvfp4_quantize(torch.randn(4, 32).half())
    with pytest.raises(KernelShapeError, match="multiple of 16"):
        nvfp4_triton.triton_nvfp4_quantize(torch.randn(4, 20))
    with pytest.raises(KernelStrideError):
        nvfp4_triton.triton_nvfp4_quantize_experts(torch.randn(2, 32, 16).transpose(1, 2))
    layout = mxfp8.padded_group_layout(torch.tensor([0, 4]), 4)
    with pytest.raises(KernelShapeError, match="2-D"):
        mxfp8_triton.triton_mxfp8_quantize_grouped_cols(torch.randn(4), layout)


def _non_finite_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of ones with one NaN / +inf / -inf at various places, an all-NaN row, and ordinary rows."""
    x = torch.cat([torch.ones(6, 64), mixed_values(4, 64, 7)])
    x[0, 5] = float("nan")  # a NaN the kernel must not drop (else amax 1.0 and the NaN element -1.0)
    x[1, 63] = float("inf")
    x[2, 0] = float("-inf")
    x[3, 31] = float("nan")
    x[3, 32] = float("inf")
    x[4] = float("nan")
    x[5, 16:32] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_rows_propagate_nan_and_inf_like_the_reference(dtype: torch.dtype) -> None:
    x = _non_finite_rows(dtype)
    ref, ours = nvfp4.nvfp4_quantize(x), nvfp4_triton.triton_nvfp4_quantize(x)
    _assert_nv_equal(ref, ours)
    deq = nvfp4.nvfp4_dequantize(ours)
    assert bool(deq[:6].isnan().all()) and bool(torch.isfinite(deq[6:]).all())


def test_nvfp4_expert_weights_propagate_nan_like_the_reference() -> None:
    w = mixed_values(4 * 20, 64, 8).reshape(4, 20, 64)
    w[1, 19, 63] = float("nan")
    w[3, 0, 0] = float("-inf")
    ref, ours = nvfp4.nvfp4_quantize_experts(w), nvfp4_triton.triton_nvfp4_quantize_experts(w)
    _assert_nv_equal(ref, ours)
    deq = nvfp4.nvfp4_dequantize(ours)
    assert bool(deq[[1, 3]].isnan().all()) and bool(torch.isfinite(deq[[0, 2]]).all())


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_mxfp8_propagates_nan_and_inf_like_the_reference(mode: ScaleMode) -> None:
    x = _non_finite_rows(torch.float32)
    _assert_mx_equal(mxfp8.mxfp8_quantize(x, mode=mode), mxfp8_triton.triton_mxfp8_quantize_rows(x, mode))
    layout = mxfp8.padded_group_layout(torch.tensor([0, 3, 10]), 10)
    xt = x[:, :48].contiguous()
    _assert_mx_equal(mxfp8.mxfp8_quantize_grouped_cols(xt, layout, mode),
                     mxfp8_triton.triton_mxfp8_quantize_grouped_cols(xt, layout, mode))
    deq = mxfp8.mxfp8_dequantize(mxfp8_triton.triton_mxfp8_quantize_rows(x, mode))
    assert bool(deq[0, :32].isnan().all()) and bool(torch.isfinite(deq[0, 32:]).all())
    assert bool(deq[1, 32:].isnan().all()) and bool(deq[2, :32].isnan().all())  # OCP: a block with +-inf is NaN
