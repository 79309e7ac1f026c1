"""The token combine of the experts: the deterministic sorted segment sum equals index_add_ on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from low_precision import ExpertsPrecision, make_experts_fn
from low_precision.routing import combine_rows, route


@pytest.fixture
def deterministic() -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def _ids(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 8])
def test_segment_sum_equals_index_add_bit_for_bit(top_k: int, dtype: torch.dtype) -> None:
    tokens, experts = 257, 16
    routing = route(_ids(tokens, experts, top_k, seed=top_k), experts)
    g = torch.Generator().manual_seed(3)
    # magnitudes over many decades: the order of the additions shows in the low bits
    rows = (torch.randn(routing.num_rows, 48, generator=g) * torch.exp(4 * torch.randn(routing.num_rows, 1,
                                                                                       generator=g))).to(dtype)
    expected = torch.zeros(tokens, 48, dtype=dtype).index_add_(0, routing.token_M, rows)
    got = combine_rows(routing, rows, tokens, deterministic=True)
    assert got.dtype == dtype and torch.equal(got, expected)
    shuffled = combine_rows(routing, rows.flip(0).flip(0), tokens, deterministic=True)
    assert torch.equal(shuffled, got)
    assert combine_rows(route(torch.zeros(0, top_k, dtype=torch.long), experts), rows[:0], 0, True).shape == (0, 48)


def test_the_deterministic_switch_selects_the_segment_sum(deterministic: None) -> None:
    routing = route(_ids(40, 8, 3, seed=1), 8)
    rows = torch.randn(routing.num_rows, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = combine_rows(routing, rows, 40)
    assert out.grad_fn is not None and "IndexAdd" not in type(out.grad_fn).__name__
    out.sum().backward()
    assert torch.equal(rows.grad, torch.ones_like(rows))


@pytest.mark.parametrize("mode", [ExpertsPrecision.REFERENCE, ExpertsPrecision.EMULATED])
def test_the_experts_op_is_the_same_with_deterministic_algorithms(mode: ExpertsPrecision) -> None:
    g = torch.Generator().manual_seed(4)
    tokens, hidden, inter, experts = 48, 64, 32, 8
    args = (torch.randn(tokens, hidden, generator=g), _ids(tokens, experts, 4, seed=5),
            torch.softmax(torch.randn(tokens, 4, generator=g), -1), torch.randn(experts, inter, hidden, generator=g),
            torch.randn(experts, inter, hidden, generator=g), torch.randn(experts, hidden, inter, generator=g))
    fn = make_experts_fn(mode)

    def run() -> list[torch.Tensor]:
        leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        y = fn(*leaves)
        y.backward(torch.ones_like(y))
        return [y.detach()] + [a.grad for a in leaves if a.is_floating_point()]

    free = run()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        pinned = run()
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(free, pinned, strict=True):
        assert torch.equal(a, b)
