"""Every rank of the trainer group takes the same decision on a step, whatever its share of the batch (issue
31): with more ranks than samples to compute, one rank computes a masked copy of a sample it does not own,
and a NaN forward on another rank made it raise (IndexError naming the copy's positions) while the others
lost gloo. Real processes, gloo, 3 ranks for 2 samples with a signal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.training.ranks import RankLayout
from tests.actors.training import rank_worker

pytestmark = pytest.mark.timeout(600)

WORLD = 3  # one rank more than the batch's samples with a signal


def _run_ranks(tmp_path: Path, scenario: str) -> list[dict]:
    out = tmp_path / scenario
    out.mkdir()
    rank_worker.launch(rank_worker.edge_main, (WORLD, scenario, str(tmp_path / f"rdzv-{scenario}"), str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("poisoned", [0, 1])
def test_a_nan_forward_is_refused_by_every_rank_idle_ones_included(tmp_path: Path, poisoned: int) -> None:
    # poisoned 0: the sample the idle rank copies (masked) is the NaN one, the case that raised
    ranks = _run_ranks(tmp_path, f"nan-forward-{poisoned}")
    for r, got in enumerate(ranks):
        m = got["metrics"]
        assert (m["skipped"], m["non_finite_sample_ids"], m["version"]) == ("loss", (f"s2-{poisoned}",), 1), r
        assert not got["moved"] and not got["has_moments"], r
    single = rank_worker.edge_step(RankLayout(), f"nan-forward-{poisoned}")["metrics"]
    assert (single["skipped"], single["non_finite_sample_ids"]) == ("loss", (f"s2-{poisoned}",))


def test_a_share_without_a_trained_token_takes_the_step_of_one_rank(tmp_path: Path) -> None:
    # one rank computes nothing of its own, one computes a sample none of whose tokens trains
    ranks = _run_ranks(tmp_path, "untrained-share")
    single = rank_worker.edge_step(RankLayout(), "untrained-share")
    for r, got in enumerate(ranks):
        m, one = got["metrics"], single["metrics"]
        assert m["skipped"] == "" and got["moved"], r
        assert m["num_trained_tokens"] == one["num_trained_tokens"] > 0, r
        for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
            assert m[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), (r, key)
        for name, theta in got["state"].items():  # the same weights on every rank, to the bit
            assert torch.equal(theta, ranks[0]["state"][name]), (r, name)
