"""The Triton kernels compiled for a real GPU against the torch reference computed on the CPU.

The same kernels run under the interpreter in tests/low_precision (every CI run); here they are compiled for
the GPU, where code generation (FMA contraction, hardware min/max, bf16 MMA) could change results the
interpreter cannot show. Skipped without CUDA. On a GPU machine: ``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from low_precision import ExpertsPrecision, experts_forward_reference, make_experts_fn, mxfp8, nvfp4
from low_precision.formats import ScaleMode
from tests.low_precision._helpers import all_bf16_values, edge_values, grouped_reference, mixed_values, sqnr_db
from tests.triton_mode import kernels_interpreted, use_triton_mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> Iterator[None]:
    was_interpreted = kernels_interpreted()
    use_triton_mode(interpret=False)
    yield
    use_triton_mode(interpret=was_interpreted)


def _backend():
    from low_precision import _backends  # after the fixture: the compiled backend

    return _backends.TRITON


def _positive_nans(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), float("nan"), x)  # widening bf16 canonicalises -NaN on the CPU


def _same(reference, ours) -> None:
    for field in ("codes", "scales", "packed", "block_scales", "global_amax"):
        if hasattr(reference, field):
            ref, got = getattr(reference, field), getattr(ours, field).cpu()
            if ref.is_floating_point():  # global_amax: NaN for a row holding a NaN or an inf (low_precision.nvfp4)
                assert torch.equal(ref.isnan(), got.isnan()), f"{field}: NaN patterns differ"
                ref, got = ref[~ref.isnan()], got[~got.isnan()]
            assert torch.equal(ref, got), f"{field}: {int((ref != got).sum())} of {ref.numel()} differ"


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_rows_byte_exact(dtype: torch.dtype, mode: ScaleMode) -> None:
    x = torch.cat([mixed_values(509, 512, 0), edge_values(torch.float32).repeat(1, 16)])
    x = _positive_nans(x.to(dtype))
    _same(mxfp8.mxfp8_quantize(x, mode=mode), _backend().mx_rows(x.to(GPU), mode))


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_mxfp8_rows_byte_exact_on_all_bf16_values(mode: ScaleMode) -> None:
    x = _positive_nans(all_bf16_values().reshape(-1, 256))
    _same(mxfp8.mxfp8_quantize(x, mode=mode), _backend().mx_rows(x.to(GPU), mode))


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_grouped_columns_byte_exact(dtype: torch.dtype, mode: ScaleMode) -> None:
    x = mixed_values(3001, 256, 1).to(dtype)
    offsets = torch.tensor([0, 0, 1000, 1000, 1033, 2990, 3001])  # empty, ragged and short groups
    layout = mxfp8.padded_group_layout(offsets, 3001)
    gpu_layout = mxfp8.padded_group_layout(offsets.to(GPU), 3001)
    _same(mxfp8.mxfp8_quantize_grouped_cols(x, layout, mode), _backend().mx_grouped_cols(x.to(GPU), gpu_layout, mode))


def test_mxfp8_expert_weights_byte_exact() -> None:
    w = mixed_values(8 * 256, 512, 2).reshape(8, 256, 512).bfloat16()
    _same(mxfp8.mxfp8_quantize_experts(w), _backend().mx_experts(w.to(GPU), ScaleMode.RCEIL))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_rows_byte_exact(dtype: torch.dtype) -> None:
    x = mixed_values(1024, 1024, 3) * torch.logspace(-10, 10, 1024)[:, None]
    x[0], x[1, :16], x[2] = 0.0, 0.0, 1e-14
    x = x.to(dtype)
    _same(nvfp4.nvfp4_quantize(x), _backend().nvfp4_rows(x.to(GPU)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_rows_with_nan_and_inf_byte_exact(dtype: torch.dtype) -> None:
    # Hardware max drops NaN: the kernels' own NaN flag must make these rows NaN like the reference's.
    x = torch.ones(64, 256)
    x[torch.arange(0, 64, 4), torch.arange(0, 256, 16)] = float("nan")
    x[torch.arange(1, 64, 4), torch.arange(3, 256, 16)] = float("inf")
    x[torch.arange(2, 64, 4), torch.arange(5, 256, 16)] = float("-inf")
    x = _positive_nans(torch.cat([x, mixed_values(64, 256, 9)]).to(dtype))
    ours = _backend().nvfp4_rows(x.to(GPU))
    _same(nvfp4.nvfp4_quantize(x), ours)
    assert int(ours.global_amax.isnan().sum()) == 48


def test_nvfp4_expert_weights_byte_exact() -> None:
    w = mixed_values(8 * 256, 512, 4).reshape(8, 256, 512)
    w[2], w[3] = 0.0, w[3] * 1e-3
    _same(nvfp4.nvfp4_quantize_experts(w), _backend().nvfp4_experts(w.to(GPU)))


def test_nvfp4_is_batch_invariant() -> None:
    x = mixed_values(300, 2048, 5).bfloat16().to(GPU)
    full = _backend().nvfp4_rows(x)
    for i in (0, 77, 299):
        alone = _backend().nvfp4_rows(x[i : i + 1].contiguous())
        assert torch.equal(alone.packed, full.packed[i : i + 1])
        assert torch.equal(alone.block_scales, full.block_scales[i : i + 1])


def _on_cpu(q):
    return dataclasses.replace(q, **{f.name: getattr(q, f.name).cpu() for f in dataclasses.fields(q)
                                     if isinstance(getattr(q, f.name), torch.Tensor)})


def _grouped_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    sizes = [700, 0, 1, 1300, 95, 0, 2000, 3]  # empty, single-row and ragged experts
    m, k, n = sum(sizes), 512, 384
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(len(sizes), n, k, generator=g).bfloat16()
    dout = torch.randn(m, n, generator=g).bfloat16()
    return x, w, dout, offsets


def test_grouped_gemms_meet_the_floors_and_agree_with_the_emulation() -> None:
    from low_precision import grouped_gemm

    b, mode = _backend(), ScaleMode.RCEIL
    x, w, dout, offsets = _grouped_problem(0)
    ref_out, ref_dx, ref_dw = grouped_reference(x, w, dout, offsets)
    xg, wg, dg, og = x.to(GPU), w.to(GPU), dout.to(GPU), offsets.to(GPU)
    layout = mxfp8.padded_group_layout(og, x.shape[0])

    xq4, wq4 = b.nvfp4_rows(xg), b.nvfp4_experts(wg)
    out4 = b.nvfp4_mm(xq4, wq4, og).cpu()
    xm, wm = b.mx_rows(xg, mode), b.mx_experts(wg, mode)
    out8 = b.mx_mm(xm, wm, og).cpu()
    dx8 = b.mx_mm(b.mx_rows(dg, mode), b.mx_experts(wg.transpose(1, 2).contiguous(), mode), og).cpu()
    dq, xc = b.mx_grouped_cols(dg, layout, mode), b.mx_grouped_cols(xg, layout, mode)
    dw8 = b.mx_wgrad(dq, xc, layout.padded_offsets_E1).cpu()

    assert sqnr_db(ref_out, out4) >= 16.0
    assert sqnr_db(ref_out, out8) >= 27.0
    assert sqnr_db(ref_dx, dx8) >= 25.0
    assert sqnr_db(ref_dw, dw8) >= 24.0
    assert bool((dw8[1] == 0).all()) and bool((dw8[5] == 0).all())  # empty experts: exact zeros
    # The same quantized operands through the torch emulation. NVFP4 (bf16 MMA, fp32 accumulation): only
    # the summation order differs. MXFP8 (FP8 MMA): Hopper's FP8 accumulator keeps about 14 bits within
    # each 32-product dot (DeepSeek-V3 report, sec. 3.3.2), so the two agree to about 14 bits, not 24.
    assert sqnr_db(grouped_gemm.nvfp4_grouped_mm(_on_cpu(xq4), _on_cpu(wq4), offsets), out4) > 100
    assert sqnr_db(grouped_gemm.mxfp8_grouped_mm(_on_cpu(xm), _on_cpu(wm), offsets), out8) > 70
    cpu_layout = mxfp8.padded_group_layout(offsets, x.shape[0])
    assert sqnr_db(grouped_gemm.mxfp8_grouped_wgrad(_on_cpu(dq), _on_cpu(xc), cpu_layout.padded_offsets_E1), dw8) > 70


def test_experts_op_forward_and_backward_on_the_gpu() -> None:
    g = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, top_k = 512, 256, 128, 8, 2
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] + 1 for _ in range(tokens)])  # expert 0 empty
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate = torch.randn(experts, inter, hidden, generator=g) / hidden**0.5
    w_up = torch.randn(experts, inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    dy = torch.randn(tokens, hidden, generator=g)

    def run(fn, device, act, master):
        leaves = [t.to(device=device, dtype=d).clone().requires_grad_()
                  for t, d in zip((x, weights, w_gate, w_up, w_down), (act, torch.float32, master, master, master),
                                  strict=True)]
        y = fn(leaves[0], ids.to(device), *leaves[1:])
        y.backward(dy.to(device=device, dtype=y.dtype))
        return [t.detach().cpu() for t in (y, *(leaf.grad for leaf in leaves))]

    ref = run(experts_forward_reference, "cpu", torch.float64, torch.float64)
    emulated = run(make_experts_fn(ExpertsPrecision.EMULATED), "cpu", torch.bfloat16, torch.float32)
    triton_gpu = run(make_experts_fn(ExpertsPrecision.TRITON), GPU, torch.bfloat16, torch.float32)
    floors = {"y": 11.0, "dx": 13.0, "d_topk_weights": 9.0, "dw_gate": 13.0, "dw_up": 13.0, "dw_down": 12.0}
    for (name, floor), r, e, t in zip(floors.items(), ref, emulated, triton_gpu, strict=True):
        assert sqnr_db(r, t) >= floor, (name, sqnr_db(r, t))
        assert sqnr_db(e, t) > 40, (name, sqnr_db(e, t))  # bf16 rounding of the inner activations differs
    for grad in triton_gpu[3:]:
        assert bool((grad[0] == 0).all())  # expert 0 received no tokens
