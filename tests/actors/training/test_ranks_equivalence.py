"""The trainer as a process group takes the step one rank takes: on the same batch and starting weights,
2 data-parallel ranks and 2 expert-parallel ranks (real processes, gloo, fp32) give the same updated
parameters as 1 rank, with router replay on and off.

Tolerances, and why. Where N ranks differ from one rank is only the order of float additions (two
partial gradients summed by the all-reduce instead of one backward's accumulation; per-expert matmuls
over other row sets), so:

- gradients (after the reduction and clipping): max |g_N - g_1| <= 2e-6 * max |g_1| per tensor
  (measured: 6.9e-7 at worst, the same for DP and EP, replay on and off).
- parameters: max |theta_N - theta_1| <= 1e-6 * max |theta_1| (the required bar) *plus* what Adam makes of
  the gradient difference: its first update is lr * g / (|g| + eps), whose change is at most
  lr * |dg| / eps per element. For |g| >> eps that term is negligible; for the ~1,500 elements whose
  gradient is below eps = 1e-8 (|g| ~ 1e-9, where summation order moves g by ~0.5%) Adam turns a 2e-11
  gradient difference into up to 9e-7 of parameter (measured worst: 2.6e-6 relative, in v_proj, at
  |g| = 5.6e-9). A bar of 1e-6 alone would fail on any reordering of float sums, not on a wrong step;
  the element-wise bound says the parameters differ by exactly what the gradients' rounding explains.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.training.ranks import RankLayout
from tests.actors.training import rank_worker

PARAM_TOLERANCE = 1e-6  # relative to the parameter tensor's largest magnitude
GRAD_TOLERANCE = 2e-6  # relative to the gradient tensor's largest magnitude
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, the learner's


def _run_ranks(tmp_path: Path, world_size: int, expert_parallel: int, replay: bool, kl_coef: float = 0.0) -> dict:
    out = tmp_path / f"w{world_size}-e{expert_parallel}-{replay}.pt"
    rendezvous = tmp_path / f"rdzv-{world_size}-{expert_parallel}-{replay}"
    rank_worker.launch(rank_worker.main, (world_size, expert_parallel, replay, kl_coef, str(rendezvous), str(out)),
                       world_size)
    return torch.load(out)


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize(("world_size", "expert_parallel"), [(2, 1), (2, 2)], ids=["2dp", "2ep"])
def test_two_ranks_take_the_step_one_rank_takes(tmp_path: Path, replay: bool, world_size: int,
                                                expert_parallel: int) -> None:
    one_state, one_metrics = rank_worker.step_once(RankLayout(), replay)
    many = _run_ranks(tmp_path, world_size, expert_parallel, replay)
    assert_same_step(one_state, one_metrics, many["state"], many["metrics"])


def assert_same_step(one_state: dict[str, torch.Tensor], one_metrics: dict, many_state: dict[str, torch.Tensor],
                     many_metrics: dict) -> None:
    """The step of N ranks is the step of one rank, within the bounds above (also tests/gpu's, with NCCL)."""
    start = rank_worker.starting_model().state_dict()
    assert one_metrics["skipped"] == "" and many_metrics["skipped"] == ""
    lr = rank_worker.LR
    for name, theta in one_state.items():
        if name.endswith(".grad"):
            continue
        got, g_one, g_many = many_state[name], one_state[f"{name}.grad"], many_state[f"{name}.grad"]
        assert got.shape == theta.shape, name
        assert not torch.equal(theta, start[name]), f"{name} did not move"
        grad_diff = (g_many - g_one).abs()
        assert float(grad_diff.max()) <= GRAD_TOLERANCE * float(g_one.abs().max()), (name, float(grad_diff.max()))
        allowed = PARAM_TOLERANCE * float(theta.abs().max()) + lr * grad_diff / ADAM_EPS
        assert bool(((got - theta).abs() <= allowed).all()), (name, float((got - theta).abs().max()))
    for key in ("num_samples", "num_computed", "num_tokens", "num_trained_tokens", "version"):
        assert many_metrics[key] == one_metrics[key], key
    for key in ("loss", "pg_loss", "grad_norm", "ratio_mean", "ratio_median", "ratio_min", "ratio_max",
                "entropy", "replay_replaced_fraction"):
        assert many_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
