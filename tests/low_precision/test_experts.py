"""The experts op in every precision against an independent float64 per-token loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from low_precision import (
    ExpertIndexError,
    ExpertsPrecision,
    KernelDTypeError,
    KernelShapeError,
    experts_forward_reference,
    make_experts_fn,
)
from tests.low_precision._helpers import sqnr_db


@dataclass(frozen=True)
class Case:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    dy: torch.Tensor

    def leaves(self, act: torch.dtype, master: torch.dtype) -> list[torch.Tensor]:
        dtypes = (act, torch.float32, master, master, master)
        tensors = (self.x, self.weights, self.w_gate, self.w_up, self.w_down)
        return [t.to(d).clone().requires_grad_() for t, d in zip(tensors, dtypes, strict=True)]


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    # expert 0 is never chosen: an empty group
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] + 1 for _ in range(tokens)])
    return Case(
        x=torch.randn(tokens, hidden, generator=g),
        ids=ids,
        weights=torch.softmax(torch.randn(tokens, top_k, generator=g), -1),
        w_gate=torch.randn(experts, inter, hidden, generator=g) / hidden**0.5,
        w_up=torch.randn(experts, inter, hidden, generator=g) / hidden**0.5,
        w_down=torch.randn(experts, hidden, inter, generator=g) / inter**0.5,
        dy=torch.randn(tokens, hidden, generator=g),
    )


SMALL = _case(tokens=24, hidden=64, inter=32, experts=4, top_k=2, seed=0)  # interpreter-sized
LARGER = _case(tokens=96, hidden=128, inter=64, experts=6, top_k=2, seed=1)


def _loop_reference(c: Case) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * W_down[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]), one token at a time."""
    x, wg, wu, wd = (t.double() for t in (c.x, c.w_gate, c.w_up, c.w_down))
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(c.ids.shape[1]):
            e = int(c.ids[t, k])
            h = torch.nn.functional.silu(wg[e] @ x[t]) * (wu[e] @ x[t])
            y[t] += c.weights[t, k].double() * (wd[e] @ h)
    return y


def _run(fn, c: Case, act: torch.dtype, master: torch.dtype) -> list[torch.Tensor]:
    x, w, wg, wu, wd = c.leaves(act, master)
    y = fn(x, c.ids, w, wg, wu, wd)
    y.backward(c.dy.to(y.dtype))
    return [y, x.grad, w.grad, wg.grad, wu.grad, wd.grad]


MIXED = (torch.bfloat16, torch.float32)  # bf16 activations, fp32 master weights


@functools.cache
def _triton_small_run() -> tuple[torch.Tensor, ...]:
    """The interpreter is slow: run the Triton experts forward + backward once for several tests."""
    return tuple(_run(make_experts_fn(ExpertsPrecision.TRITON), SMALL, *MIXED))


def _float64_run(c: Case) -> list[torch.Tensor]:
    return _run(experts_forward_reference, c, torch.float64, torch.float64)


def test_reference_matches_the_per_token_loop() -> None:
    y = experts_forward_reference(SMALL.x.double(), SMALL.ids, SMALL.weights.double(),
                                  SMALL.w_gate.double(), SMALL.w_up.double(), SMALL.w_down.double())  # fmt: skip
    assert torch.allclose(y, _loop_reference(SMALL), rtol=1e-10, atol=1e-12)
    y_bf16 = _run(make_experts_fn(ExpertsPrecision.REFERENCE), SMALL, torch.bfloat16, torch.bfloat16)[0]
    assert y_bf16.dtype == torch.bfloat16 and sqnr_db(_loop_reference(SMALL), y_bf16) > 30


@pytest.mark.parametrize(
    ("mode", "case"),
    [(ExpertsPrecision.EMULATED, LARGER), (ExpertsPrecision.TRITON, SMALL)],
    ids=["emulated", "triton"],
)
def test_quantized_experts_forward_and_gradients_track_float64(mode: ExpertsPrecision, case: Case) -> None:
    ref = _float64_run(case)
    got = _triton_small_run() if mode is ExpertsPrecision.TRITON else _run(make_experts_fn(mode), case, *MIXED)
    names = ["y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"]
    # two chained NVFP4 GEMMs forward (~17 dB each), MXFP8 backward on top of the NVFP4 activations
    # (measured on these cases: y 12.1-12.6, dx 14.9-16.2, d_topk 10.3-11.4, dw 13.7-16.9 dB)
    floors = {"y": 11.0, "dx": 13.0, "d_topk_weights": 9.0, "dw_gate": 13.0, "dw_up": 13.0, "dw_down": 12.0}
    for name, r, g in zip(names, ref, got, strict=True):
        assert sqnr_db(r, g) >= floors[name], (name, sqnr_db(r, g))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in got[3:])  # fp32 master weights keep fp32 gradients
    for grad in got[3:]:
        assert bool((grad[0] == 0).all())  # expert 0 received no tokens


def test_triton_equals_emulation() -> None:
    emulated = _run(make_experts_fn(ExpertsPrecision.EMULATED), SMALL, *MIXED)
    for e, t in zip(emulated, _triton_small_run(), strict=True):
        assert sqnr_db(e, t) > 60


def test_bf16_master_weights_get_bf16_gradients() -> None:
    got = _run(make_experts_fn(ExpertsPrecision.EMULATED), SMALL, torch.bfloat16, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got[3:])
    assert sqnr_db(_float64_run(SMALL)[3], got[3]) > 12


def test_quantized_forward_is_batch_invariant() -> None:
    fn = make_experts_fn(ExpertsPrecision.EMULATED)
    args = (LARGER.w_gate, LARGER.w_up, LARGER.w_down)
    with torch.no_grad():
        full = fn(LARGER.x, LARGER.ids, LARGER.weights, *args)
        for i in (0, 17, 95):
            alone = fn(LARGER.x[i : i + 1], LARGER.ids[i : i + 1], LARGER.weights[i : i + 1], *args)
            assert torch.allclose(alone[0], full[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", list(ExpertsPrecision))
def test_no_tokens(mode: ExpertsPrecision) -> None:
    c = SMALL
    y = make_experts_fn(mode)(c.x[:0], c.ids[:0], c.weights[:0], c.w_gate, c.w_up, c.w_down)
    assert y.shape == (0, 64)


def test_bad_arguments_are_rejected() -> None:
    c = SMALL
    fn = make_experts_fn(ExpertsPrecision.EMULATED)
    with pytest.raises(ExpertIndexError, match=r"\[0, 4\)"):
        fn(c.x, c.ids + 3, c.weights, c.w_gate, c.w_up, c.w_down)
    with pytest.raises(KernelShapeError, match="multiple of 32"):
        fn(c.x[:, :48], c.ids, c.weights, c.w_gate[:, :, :48], c.w_up[:, :, :48], c.w_down[:, :48])
    with pytest.raises(KernelShapeError, match="w_down_EDF"):
        fn(c.x, c.ids, c.weights, c.w_gate, c.w_up, c.w_down[:, :, :16])
    with pytest.raises(KernelShapeError, match="topk_ids_TK"):
        fn(c.x, c.ids[:5], c.weights, c.w_gate, c.w_up, c.w_down)
    with pytest.raises(KernelDTypeError, match="float16"):
        fn(c.x.half(), c.ids, c.weights, c.w_gate, c.w_up, c.w_down)
    with pytest.raises(TypeError, match="ExpertsPrecision"):
        make_experts_fn("triton")  # type: ignore[arg-type]


def test_frozen_weights_get_no_gradient_and_x_still_does() -> None:
    c = SMALL
    x = c.x.clone().requires_grad_()
    y = make_experts_fn(ExpertsPrecision.EMULATED)(x, c.ids, c.weights, c.w_gate, c.w_up, c.w_down)
    y.backward(c.dy)
    assert x.grad is not None and sqnr_db(_float64_run(c)[1], x.grad) > 13
    w_down = c.w_down.clone().requires_grad_()
    y = make_experts_fn(ExpertsPrecision.EMULATED)(c.x, c.ids, c.weights, c.w_gate, c.w_up, w_down)
    y.backward(c.dy)
    assert w_down.grad is not None and sqnr_db(_float64_run(c)[5], w_down.grad) > 12


@pytest.mark.parametrize("mode", [ExpertsPrecision.EMULATED, ExpertsPrecision.TRITON], ids=["emulated", "triton"])
def test_non_finite_values_propagate_through_the_quantized_forward(mode: ExpertsPrecision) -> None:
    """A token holding an inf gives a non-finite output row, as in full precision (before the NVFP4
    rule the quantized op turned +inf into 2688 and returned a finite row); an expert weight holding a
    NaN makes every token routed to that expert non-finite; every other token stays finite and close."""
    c = SMALL
    x, w_up = c.x.clone(), c.w_up.clone()
    x[3, 10] = float("inf")
    w_up[2, 7, 5] = float("nan")
    fn = make_experts_fn(mode)
    with torch.no_grad():
        got = fn(x, c.ids, c.weights, c.w_gate, w_up, c.w_down)
        full = experts_forward_reference(x.double(), c.ids, c.weights.double(), c.w_gate.double(),
                                         w_up.double(), c.w_down.double())
    bad_full = ~torch.isfinite(full).all(dim=1)
    assert bool(bad_full[3]) and int(bad_full.sum()) > 1  # the token, and expert 2's tokens
    assert torch.equal(~torch.isfinite(got).all(dim=1), bad_full)
    assert bool(got[bad_full].isnan().all())  # the documented rule: NaN rows
    assert sqnr_db(full[~bad_full], got[~bad_full]) > 11
