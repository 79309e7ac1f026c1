"""Run-to-run bit equality of the experts on a GPU with torch.use_deterministic_algorithms(True).

CUDA's index_add_ combines a token's K expert results with float atomics, in whatever order threads
arrive: different low bits from run to run for K >= 3. With deterministic algorithms on, the experts
combine by a sorted segment sum (low_precision.routing.combine_rows). Skipped without CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from low_precision import ExpertsPrecision, make_experts_fn
from low_precision.routing import combine_rows, route
from tests.triton_mode import kernels_interpreted, use_triton_mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def compiled_deterministic() -> Iterator[None]:
    was_interpreted = kernels_interpreted()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, read at first use
    use_triton_mode(interpret=False)
    # warn_only: cuBLAS may have started before the variable above was set; the tests check the bits
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was_deterministic)
    use_triton_mode(interpret=was_interpreted)


def _inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(top_k)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    wg = torch.randn(experts, inter, hidden, generator=g) / hidden**0.5
    wu = torch.randn(experts, inter, hidden, generator=g) / hidden**0.5
    wd = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return [t.to(GPU) for t in (x.to(dtype), ids, w, wg, wu, wd)]


def _run(fn, args) -> list[torch.Tensor]:
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    y = fn(*leaves)
    y.backward(torch.ones_like(y) * 0.01)
    return [y.detach()] + [a.grad for a in leaves if a.is_floating_point()]


@pytest.mark.parametrize("top_k", [3, 4, 8])
def test_segment_sum_is_bit_identical_run_to_run(top_k: int) -> None:
    tokens, experts = 8192, 64
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(GPU)
    routing = route(ids, experts)
    rows = torch.randn(routing.num_rows, 512, device=GPU) * torch.exp(4 * torch.randn(routing.num_rows, 1, device=GPU))
    first = combine_rows(routing, rows, tokens)
    for _ in range(5):
        assert torch.equal(combine_rows(routing, rows, tokens), first)
    on_cpu = combine_rows(route(ids.cpu(), experts), rows.cpu(), tokens, deterministic=False)  # index_add_
    assert torch.equal(first.cpu(), on_cpu)


@pytest.mark.parametrize("mode", [ExpertsPrecision.TRITON, ExpertsPrecision.REFERENCE])
@pytest.mark.parametrize("top_k", [3, 4])
def test_experts_forward_and_backward_are_bit_identical_run_to_run(mode: ExpertsPrecision, top_k: int) -> None:
    args = _inputs(tokens=4096, hidden=256, inter=128, experts=16, top_k=top_k, dtype=torch.bfloat16)
    fn = make_experts_fn(mode)
    first = _run(fn, args)
    for _ in range(3):
        for a, b in zip(first, _run(fn, args), strict=True):
            assert torch.equal(a, b)
