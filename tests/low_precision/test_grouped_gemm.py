"""Grouped GEMMs (torch emulation and Triton under the interpreter) against a float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from low_precision import _backends
from low_precision.errors import KernelDTypeError, KernelShapeError, KernelStrideError
from low_precision.grouped_gemm import mxfp8_grouped_mm, mxfp8_grouped_wgrad, nvfp4_grouped_mm
from low_precision.grouped_gemm_triton import (
    triton_mxfp8_grouped_mm,
    triton_mxfp8_grouped_wgrad,
    triton_nvfp4_grouped_mm,
)
from low_precision.mxfp8 import MXTensor, mxfp8_dequantize, mxfp8_quantize, mxfp8_quantize_experts, padded_group_layout
from low_precision.nvfp4 import nvfp4_quantize, nvfp4_quantize_experts
from tests.low_precision._helpers import grouped_reference, sqnr_db

BACKENDS = {"emulated": _backends.EMULATED, "triton": _backends.TRITON}


@dataclass(frozen=True)
class Problem:
    x_MK: torch.Tensor
    w_ENK: torch.Tensor
    dout_MN: torch.Tensor
    offsets_E1: torch.Tensor


def _problem(backend: str, seed: int = 0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    if backend == "emulated":
        m, k, n, sizes = 512, 256, 128, [100, 0, 250, 162]
    else:  # the interpreter is slow: small but ragged, with an empty expert
        m, k, n, sizes = 80, 64, 64, [37, 0, 43]
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    assert int(offsets[-1]) == m
    return Problem(
        x_MK=torch.randn(m, k, generator=g).bfloat16(),
        w_ENK=torch.randn(len(sizes), n, k, generator=g).bfloat16(),
        dout_MN=torch.randn(m, n, generator=g).bfloat16(),
        offsets_E1=offsets,
    )


def _reference(p: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grouped_reference(p.x_MK, p.w_ENK, p.dout_MN, p.offsets_E1)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mxfp8_grouped_gemms_meet_torchao_floors(backend: str) -> None:
    b, p = BACKENDS[backend], _problem(backend)
    mode = _backends.ScaleMode.RCEIL
    out = b.mx_mm(b.mx_rows(p.x_MK, mode), b.mx_experts(p.w_ENK, mode), p.offsets_E1)
    w_t = b.mx_experts(p.w_ENK.transpose(1, 2).contiguous(), mode)  # (E, K, N) quantized along N
    dx = b.mx_mm(b.mx_rows(p.dout_MN, mode), w_t, p.offsets_E1)
    layout = padded_group_layout(p.offsets_E1, p.x_MK.shape[0])
    dw = b.mx_wgrad(
        b.mx_grouped_cols(p.dout_MN, layout, mode), b.mx_grouped_cols(p.x_MK, layout, mode), layout.padded_offsets_E1
    )
    ref_out, ref_dx, ref_dw = _reference(p)
    assert sqnr_db(ref_out, out) >= 27.0
    assert sqnr_db(ref_dx, dx) >= 25.0
    assert sqnr_db(ref_dw, dw) >= 24.0
    assert bool((dw[1] == 0).all())  # the empty expert gets an exact zero gradient


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_nvfp4_grouped_gemm_meets_floor(backend: str) -> None:
    b, p = BACKENDS[backend], _problem(backend, seed=1)
    out = b.nvfp4_mm(b.nvfp4_rows(p.x_MK), b.nvfp4_experts(p.w_ENK), p.offsets_E1)
    assert sqnr_db(_reference(p)[0], out) >= 16.0


def test_triton_gemms_agree_with_the_emulation() -> None:
    p = _problem("triton", seed=2)
    off = p.offsets_E1
    xq, wq = nvfp4_quantize(p.x_MK), nvfp4_quantize_experts(p.w_ENK)
    assert sqnr_db(nvfp4_grouped_mm(xq, wq, off), triton_nvfp4_grouped_mm(xq, wq, off)) > 100
    xm, wm = mxfp8_quantize(p.x_MK), mxfp8_quantize_experts(p.w_ENK)
    assert sqnr_db(mxfp8_grouped_mm(xm, wm, off), triton_mxfp8_grouped_mm(xm, wm, off)) > 100
    layout = padded_group_layout(off, p.x_MK.shape[0])
    dq = _backends.EMULATED.mx_grouped_cols(p.dout_MN, layout, _backends.ScaleMode.RCEIL)
    xc = _backends.EMULATED.mx_grouped_cols(p.x_MK, layout, _backends.ScaleMode.RCEIL)
    poff = layout.padded_offsets_E1
    assert sqnr_db(mxfp8_grouped_wgrad(dq, xc, poff), triton_mxfp8_grouped_wgrad(dq, xc, poff)) > 100


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_all_rows_in_one_expert_and_no_rows_at_all(backend: str) -> None:
    b = BACKENDS[backend]
    x = torch.randn(33, 32)
    w = torch.randn(3, 16, 32)
    off = torch.tensor([0, 0, 33, 33])
    out = b.nvfp4_mm(b.nvfp4_rows(x), b.nvfp4_experts(w), off)
    assert sqnr_db(x @ w[1].t(), out) > 15
    empty = b.nvfp4_mm(b.nvfp4_rows(x[:0]), b.nvfp4_experts(w), torch.zeros(4, dtype=torch.int64))
    assert empty.shape == (0, 16)


def test_bad_operands_are_rejected_with_clear_errors() -> None:
    x, w = torch.randn(8, 64), torch.randn(2, 16, 64)
    off = torch.tensor([0, 3, 8])
    xm, wm = mxfp8_quantize(x), mxfp8_quantize_experts(w)
    with pytest.raises(KernelShapeError, match="reduction dims differ"):
        triton_mxfp8_grouped_mm(xm, mxfp8_quantize_experts(torch.randn(2, 16, 32)), off)
    with pytest.raises(KernelShapeError, match="from 0 to 8"):
        triton_mxfp8_grouped_mm(xm, wm, torch.tensor([0, 3, 7]))
    with pytest.raises(KernelShapeError, match="num_experts"):
        triton_mxfp8_grouped_mm(xm, wm, torch.tensor([0, 2, 3, 8]))
    with pytest.raises(KernelShapeError, match="non-decreasing"):
        mxfp8_grouped_mm(xm, wm, torch.tensor([0, 9, 8]))
    with pytest.raises(KernelDTypeError, match="offsets"):
        triton_mxfp8_grouped_mm(xm, wm, off.float())
    strided = MXTensor(codes=xm.codes.t().contiguous().t(), scales=xm.scales, dim=-1, mode=xm.mode)
    with pytest.raises(KernelStrideError, match="contiguous"):
        triton_mxfp8_grouped_mm(strided, wm, off)
    wrong_dtype = MXTensor(codes=xm.codes.to(torch.int32), scales=xm.scales, dim=-1, mode=xm.mode)
    with pytest.raises(KernelDTypeError, match="uint8"):
        triton_mxfp8_grouped_mm(wrong_dtype, wm, off)
    with pytest.raises(KernelShapeError, match="along tokens"):
        triton_mxfp8_grouped_wgrad(xm, xm, off)
    with pytest.raises(KernelShapeError, match="reduction dims differ"):
        triton_nvfp4_grouped_mm(nvfp4_quantize(x), nvfp4_quantize_experts(torch.randn(2, 16, 32)), off)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mxfp8_gemms_do_not_overflow_where_the_products_do_not(backend: str) -> None:
    """Blocks whose two scales multiply past float32 (2^100 * 2^40) while their products are 0 or
    finite: applying the scales one operand at a time keeps the result that of the dequantized operands
    (their product first gave inf, and 0 * inf = NaN, in the weight gradient while dX stayed finite)."""
    b, mode = BACKENDS[backend], _backends.ScaleMode.RCEIL
    m, k, n = 32, 64, 32
    a, w = torch.zeros(m, k), torch.zeros(1, n, k)
    a[:, 0] = 2.0**108  # A's first K-block: scale 2^100, nonzero only in column 0
    w[0, :, 1] = 2.0**48  # B's first K-block: scale 2^40, zero in column 0
    a[:, 33:40], w[0, :, 33:40] = 1.5, -2.0  # an ordinary second block
    offsets = torch.tensor([0, m])
    aq, wq = b.mx_rows(a, mode), b.mx_experts(w, mode)
    out = b.mx_mm(aq, wq, offsets)
    deq = mxfp8_dequantize
    expected = deq(_cpu(aq)).double() @ deq(_cpu(wq)).double()[0].t()  # -21 everywhere
    assert torch.equal(out.double(), expected)
    layout = padded_group_layout(offsets, m)
    g, x = torch.zeros(m, 32), torch.zeros(m, 32)  # the weight gradient reduces over tokens: dim 0
    g[0], x[1] = 2.0**108, 2.0**48
    g[5:9], x[5:9] = 3.0, 0.25
    gq, xq = b.mx_grouped_cols(g, layout, mode), b.mx_grouped_cols(x, layout, mode)
    dw = b.mx_wgrad(gq, xq, layout.padded_offsets_E1)
    expected_dw = deq(_cpu(gq)).double().t() @ deq(_cpu(xq)).double()  # 3 everywhere
    assert torch.equal(dw[0].double(), expected_dw)


def _cpu(q: MXTensor) -> MXTensor:
    return MXTensor(codes=q.codes.cpu(), scales=q.scales.cpu(), dim=q.dim, mode=q.mode)
