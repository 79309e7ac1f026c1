"""tests.bench.latency_tail at a tiny size: real runs with the environment's latency on (tasks.latency), one
synchronous and one asynchronous, and its JSON line's figures (about a minute on 2 cores, so ``slow``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import latency_tail

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_the_bench_measures_both_modes_with_the_latency_really_on(tmp_path: Path) -> None:
    result = latency_tail.main(["--trials", "1", "--steps", "2", "--etas", "1", "--tool-median-s", "0.2",
                                "--test-median-s", "0.2", "--keep", str(tmp_path)])
    json.dumps(result)  # the line it prints
    sync, eta1 = result["sync"], result["async"]["eta=1"]
    assert result["latency"]["p99_over_median"] >= 20
    assert sync["num_samples"] == 2 * 4 * 2 and sync["num_stragglers_cut"] == [0]  # eta = 0 waits for every episode
    # an asynchronous step trains a due group without its stragglers (those cut are counted)
    assert 2 * 4 * 2 - sum(eta1["num_stragglers_cut"]) <= eta1["num_samples"] <= 2 * 4 * 2
    for mode, eta in ((sync, 0), (eta1, 1)):
        assert mode["samples_per_s"] > 0 and 0 < mode["trainer_busy_share"] < 1
        assert mode["lag_max"] <= eta and mode["lag_within_eta"]
        assert len(mode["learning_curve"]["reward_mean"]) == 2
        (run,) = mode["runs"]
        assert run["exit_code"] == 0
        # every grading waited its delay (the test latency is drawn per sample: its median is near 0.2 s)
        assert run["env_delay"]["test"]["median_s"] > 0.02, run["env_delay"]
    assert eta1["ratio_vs_sync"] == pytest.approx(eta1["samples_per_s"] / sync["samples_per_s"], rel=1e-2)
    assert set(result["checks"]) == {"staleness_within_eta", "eta=1_learning_no_worse"}
    assert result["checks"]["staleness_within_eta"]
