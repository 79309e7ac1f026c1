"""Per-token NVFP4 reference: an independent re-derivation, batch invariance and published error figures."""

from __future__ import annotations

import pytest
import torch

from low_precision.errors import KernelDTypeError, KernelShapeError
from low_precision.nvfp4 import (
    NVFP4Tensor,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_experts,
)
from tests.low_precision._helpers import sqnr_db

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 to float32: a float64 product or quotient of two float32 values, rounded once,
    equals the IEEE float32 operation."""
    return x.float().double()


def _e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    a = v.abs().clamp(max=6.0)
    dist = (a[..., None] - GRID).abs()
    best = dist.min(-1, keepdim=True).values
    idx = torch.arange(8).expand_as(dist)
    cand = dist == best
    even = torch.where(cand & (idx % 2 == 0), idx, 99).min(-1).values
    first = torch.where(cand, idx, 99).min(-1).values
    code = torch.where(cand.sum(-1) > 1, even, first)
    return code | ((v.float().view(torch.int32) < 0).to(torch.int64) * 8)


def _independent_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The TransformerEngine per-token chain in float64 with float32 rounding at every step."""
    x = x.double()
    amax = x.abs().amax(-1)
    s_enc = _f32(2688.0 / amax.clamp(min=_f32(torch.tensor(1e-12)).item()))
    s_enc = torch.where((s_enc == 0) | torch.isinf(s_enc), 1.0, s_enc)
    blocks = x.reshape(x.shape[0], -1, 16)
    mult = _f32(s_enc * _f32(torch.tensor(1.0 / 6.0)))
    scale_in = _f32(blocks.abs().amax(-1) * mult[:, None]).clamp(max=448.0)
    scale_codes = scale_in.float().to(torch.float8_e4m3fn)
    dec = scale_codes.double()
    enc = torch.where(dec == 0, 0.0, _f32(s_enc[:, None] / torch.where(dec == 0, 1.0, dec)))
    codes = _e2m1_rne(_f32(blocks * enc[..., None]).clamp(-6.0, 6.0)).reshape(x.shape)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale_codes.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_an_independent_float64_derivation(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g) * torch.logspace(-8, 4, 256)[:, None]
    x[0] = 0.0
    x[1, :16] = 0.0
    x = x.to(dtype)
    q = nvfp4_quantize(x)
    packed, scales = _independent_nvfp4(x)
    assert torch.equal(q.packed, packed)
    assert torch.equal(q.block_scales, scales)


def test_scale_uses_ieee_division_not_reciprocal_multiply() -> None:
    """S_enc / dec rounded once differs from S_enc * (1 / dec) on some blocks; ours is the former."""
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = nvfp4_quantize(x)
    packed, scales = _independent_nvfp4(x)
    assert torch.equal(q.packed, packed) and torch.equal(q.block_scales, scales)
    s_enc = (2688.0 / x.float().abs().amax(-1)).float()  # python float / tensor: reciprocal multiply
    ieee = torch.tensor(2688.0) / x.float().abs().amax(-1)
    assert not torch.equal(s_enc, ieee), "torch computed python_float / tensor exactly: pitfall is moot"


def test_rows_are_batch_invariant_bytewise() -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-5, 5, 64)[:, None]).bfloat16()
    full = nvfp4_quantize(x)
    for i in range(0, 64, 7):
        alone = nvfp4_quantize(x[i : i + 1])
        assert torch.equal(alone.packed, full.packed[i : i + 1])
        assert torch.equal(alone.block_scales, full.block_scales[i : i + 1])
        assert torch.equal(alone.global_amax, full.global_amax[i : i + 1])
    # a louder batch-mate must not change a row's bytes
    louder = x.clone()
    louder[0] *= 1e4
    assert torch.equal(nvfp4_quantize(louder).packed[1:], full.packed[1:])


def test_sqnr_on_bf16_randn_is_about_20_4_db() -> None:
    x = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(3)).bfloat16()
    db = sqnr_db(x, nvfp4_dequantize(nvfp4_quantize(x)))
    assert 20.1 < db < 20.7, db


def test_worst_row_over_a_wide_dynamic_range_is_at_least_19_db() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 1024, generator=g) * torch.logspace(-6, 0, 512)[:, None]
    deq = nvfp4_dequantize(nvfp4_quantize(x))
    per_row = 20 * torch.log10(x.double().norm(dim=1) / (x.double() - deq.double()).norm(dim=1))
    assert float(per_row.min()) >= 19.0, float(per_row.min())


def test_zero_and_tiny_rows_dequantize_consistently() -> None:
    x = torch.zeros(3, 32)
    x[1] = 1e-14  # below the 1e-12 amax floor
    x[2, 3] = -5.0
    q = nvfp4_quantize(x)
    deq = nvfp4_dequantize(q)
    assert bool((deq[0] == 0).all())
    # amax is floored at 1e-12 for the encode scale and the dequantization uses the same floor
    assert q.global_amax[1].item() == pytest.approx(1e-12)
    assert torch.allclose(deq[1], x[1], rtol=0.05)
    assert deq[2, 3].item() == -5.0 and bool((deq[2, :3] == 0).all())


def test_expert_weights_get_one_scale_per_expert() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 16, 64, generator=g)
    w[1] *= 1e3
    q = nvfp4_quantize_experts(w)
    assert q.global_amax.shape == (3,)
    assert torch.allclose(q.global_amax, w.abs().amax(dim=(1, 2)))
    alone = nvfp4_quantize_experts(w[2:3])
    assert torch.equal(alone.packed[0], q.packed[2])  # other experts do not leak in
    assert sqnr_db(w, nvfp4_dequantize(q)) > 19.5
    flat = nvfp4_quantize(w[0].reshape(1, -1))  # one scale over the whole expert, blocks along K
    assert torch.equal(flat.packed.reshape(16, 32), q.packed[0])


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(KernelShapeError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(4, 24))
    with pytest.raises(KernelDTypeError):
        nvfp4_quantize(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(KernelShapeError, match="3-D"):
        nvfp4_quantize_experts(torch.randn(4, 32))
    assert isinstance(nvfp4_quantize(torch.randn(0, 32)), NVFP4Tensor)


def _same_nan_pattern(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_with_a_nan_or_an_infinity_quantizes_to_nan(poison: float, dtype: torch.dtype) -> None:
    # The rule (low_precision.nvfp4): the whole row NaN. Before it, +inf became the finite 2688 and the rest
    # of the row 0.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(12))
    x[2, 17] = poison
    x = x.to(dtype)
    q = nvfp4_quantize(x)
    deq = nvfp4_dequantize(q)
    assert bool(deq[2].isnan().all()) and bool(q.global_amax[2].isnan())
    assert q.block_scales[2].tolist() == [0x7F] * 4 and q.packed[2].tolist() == [0] * 32
    assert bool(torch.isfinite(deq[[0, 1, 3]]).all())
    for i in range(4):  # batch invariance holds for the poisoned row too
        alone = nvfp4_quantize(x[i : i + 1])
        assert torch.equal(alone.packed, q.packed[i : i + 1])
        assert torch.equal(alone.block_scales, q.block_scales[i : i + 1])
        assert _same_nan_pattern(alone.global_amax, q.global_amax[i : i + 1])


def test_an_expert_with_a_non_finite_weight_quantizes_to_nan() -> None:
    w = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(13))
    w[1, 5, 3] = float("inf")
    q = nvfp4_quantize_experts(w)
    deq = nvfp4_dequantize(q)
    assert bool(deq[1].isnan().all()) and bool(torch.isfinite(deq[[0, 2]]).all())
    assert bool(q.global_amax[1].isnan()) and bool((q.block_scales[1] == 0x7F).all())


def test_finite_extremes_stay_finite() -> None:
    top = torch.finfo(torch.float32).max
    x = torch.tensor([[top, -top] + [1.0] * 14, [1e-45] * 16, [0.0] * 16])
    deq = nvfp4_dequantize(nvfp4_quantize(x))
    assert bool(torch.isfinite(deq).all()) and float(deq[0, 0]) == pytest.approx(top, rel=1e-6)
