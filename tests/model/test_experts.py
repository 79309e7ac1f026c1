"""The reference expert computation against a per-token loop, with gradients and empty experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.experts import reference_experts_forward


def _naive(x, ids, w, wg, wu, wd):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = F.silu(wg[e] @ x[t]) * (wu[e] @ x[t])
            out[t] = out[t] + w[t, k] * (wd[e] @ h)
    return out


@pytest.mark.parametrize("t", [11, 400])  # few rows per expert: separate gate/up; many: fused gate-up
def test_reference_experts_match_naive_loop_and_gradients(t: int) -> None:
    gen = torch.Generator().manual_seed(0)
    d, f, e, k = 8, 6, 5, 2
    x = torch.randn(t, d, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(t)])  # expert 4 never used
    w = torch.rand(t, k, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = [
        torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
        for shape in ((e, f, d), (e, f, d), (e, d, f))
    ]
    got = reference_experts_forward(x, ids, w, *weights)
    ref = _naive(x, ids, w, *weights)
    assert torch.allclose(got, ref)
    g_got = torch.autograd.grad(got.square().sum(), [x, w, *weights])
    g_ref = torch.autograd.grad(ref.square().sum(), [x, w, *weights])
    for a, b in zip(g_got, g_ref, strict=True):
        assert torch.allclose(a, b)
    assert torch.count_nonzero(g_got[2][4]) == 0  # unused expert: no gradient


def test_single_token_result_does_not_depend_on_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=gen)
    ids = torch.randint(0, 4, (32, 1), generator=gen)
    w = torch.ones(32, 1)
    weights = [torch.randn(s, generator=gen) for s in ((4, 8, 16), (4, 8, 16), (4, 16, 8))]
    full = reference_experts_forward(x, ids, w, *weights)
    for i in (0, 7, 31):
        one = reference_experts_forward(x[i : i + 1], ids[i : i + 1], w[i : i + 1], *weights)
        assert torch.allclose(one[0], full[i], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 11, 400])
def test_no_grad_path_equals_autograd_path_bit_for_bit(t: int, dtype: torch.dtype) -> None:
    """Generation runs the experts without autograd (grouped matmuls); its numbers must be the training path's."""
    gen = torch.Generator().manual_seed(2)
    d, f, e, k = 16, 8, 5, 2
    x = torch.randn(t, d, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(t)])  # expert 4 never used
    w = torch.rand(t, k, generator=gen).to(dtype)
    weights = [torch.randn(s, generator=gen).to(dtype) for s in ((e, f, d), (e, f, d), (e, d, f))]
    with torch.inference_mode():
        fast = reference_experts_forward(x, ids, w, *weights)
    params = [p.clone().requires_grad_() for p in weights]
    slow = reference_experts_forward(x, ids, w, *params)
    assert torch.equal(fast, slow.detach())


def _graph_size(y: torch.Tensor) -> int:
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return len(seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_graph_does_not_grow_with_experts_and_matches_the_loop(dtype: torch.dtype) -> None:
    """On CPU the trained experts run as grouped matmuls both ways (a fixed graph, however many experts),
    with the per-token loop's values and gradients."""
    sizes = []
    for e in (4, 16):
        gen = torch.Generator().manual_seed(e)
        t, d, f, k = 64, 16, 8, 2
        x = torch.randn(t, d, generator=gen).to(dtype).requires_grad_()
        ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # last expert unused
        w = torch.rand(t, k, generator=gen).to(dtype).requires_grad_()
        weights = [
            (torch.randn(s, generator=gen) * 0.3).to(dtype).requires_grad_() for s in ((e, f, d), (e, f, d), (e, d, f))
        ]
        got = reference_experts_forward(x, ids, w, *weights)
        sizes.append(_graph_size(got))
        f64 = [p.detach().double().requires_grad_() for p in (x, w, *weights)]
        ref = _naive(f64[0], ids, *f64[1:])
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        assert torch.allclose(got.double(), ref, atol=tol, rtol=tol)
        g_got = torch.autograd.grad(got.float().square().sum(), [x, w, *weights])
        g_ref = torch.autograd.grad(ref.square().sum(), f64)
        for a, b in zip(g_got, g_ref, strict=True):
            assert torch.allclose(a.double(), b, atol=tol * 10, rtol=tol * 10)
        assert torch.count_nonzero(g_got[2][e - 1]) == 0  # unused expert: no gradient
    assert sizes[0] == sizes[1]
