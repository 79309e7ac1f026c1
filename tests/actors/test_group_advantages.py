"""The grouping stage's advantages: Dr. GRPO's of finite rewards; a group with a NaN or infinite reward is
refused, naming its samples (``[-inf, -inf]`` must not pass as a group without signal). Computed without
torch (the grouping process loads none), they are torch's (`_torch`, the same computation in torch) bit for
bit wherever torch's float64 sum is exact, and within its rounding elsewhere."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors._stage import WorkRefused
from actors.records import RewardBreakdown, RewardRecord
from actors.stages.grouping import dr_grpo_advantages, group_advantages


def _rewards(values: list[float]) -> list[RewardRecord]:
    return [RewardRecord(f"s{i}", "p0", f"samples/s{i}/a0", r, RewardBreakdown(0.0, 0, 1, 0.0, 0.0, 0, 0.0, r), ())
            for i, r in enumerate(values)]


def test_finite_rewards_get_dr_grpo_advantages() -> None:
    assert group_advantages("g0", _rewards([1.0, 0.0, 0.5])) == [0.5, -0.5, 0.0]
    assert group_advantages("g0", _rewards([0.1, 0.1, 0.1])) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("values", "named"), [
    ([-math.inf, -math.inf], ["s0", "s1"]),
    ([math.inf, math.inf], ["s0", "s1"]),
    ([0.5, -math.inf], ["s1"]),
    ([1.0, math.nan, 0.0], ["s1"]),
    ([0.0, 1.0, math.inf], ["s2"]),
])
def test_a_group_with_a_non_finite_reward_is_refused_naming_the_samples(values: list[float],
                                                                        named: list[str]) -> None:
    with pytest.raises(WorkRefused, match="non-finite rewards") as refused:
        group_advantages("g7", _rewards(values))
    message = str(refused.value)
    assert "g7" in message and all(f"'{s}'" in message for s in named)
    assert all(f"'{s}'" not in message for s in {f"s{i}" for i in range(len(values))} - set(named))


def _torch(rewards: list[float]) -> list[float]:
    """The independent reference: Dr. GRPO in torch float64 as grouping computed it before it loaded no torch
    (all-equal rewards exactly 0)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    return (torch.zeros_like(r) if bool((r == r[0]).all()) else r - r.mean()).tolist()


def test_advantages_are_mean_centred_without_std_scaling() -> None:
    adv = dr_grpo_advantages([1.0, 0.0, 0.0, 3.0])
    assert adv == [0.0, -1.0, -1.0, 2.0]
    assert dr_grpo_advantages([10.0, 0.0, 0.0, 30.0]) == pytest.approx([a * 10 for a in adv])


def _bits(values: list[float]) -> list[str]:
    return [v.hex() for v in values]  # -0.0 and 0.0 differ here, as they would in a stored record


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.integers(-256, 256), min_size=1, max_size=64), st.integers(0, 12))
def test_exact_sums_give_torchs_advantages_bit_for_bit(steps: list[int], scale: int) -> None:
    """Rewards on a binary grid (pass fractions 0, 1/4, 1/2, ... and the like): every partial sum is exact in
    float64 whatever the order, so the mean is rounded once, the same way, and every bit agrees."""
    rewards = [k * 2.0**-scale for k in steps]
    assert _bits(dr_grpo_advantages(rewards)) == _bits(_torch(rewards))


@pytest.mark.parametrize("rewards", [[0.7], [0.1, 0.1, 0.1], [-0.0, 0.0], [1e300, 1e300], [0.3] * 64, [2.5, -1.0],
                                     [0.1, 0.2, 0.1, 0.2], [1.0, 0.0, 0.0, 1.0, 1.0]])
def test_one_sample_ties_and_all_equal_are_torchs(rewards: list[float]) -> None:
    assert _bits(dr_grpo_advantages(rewards)) == _bits(_torch(rewards))


def test_any_rewards_are_torchs_within_its_rounding() -> None:
    """Any floats: torch's sum adds in an order of its CPU's vector width (4 lanes on AVX2, 8 on AVX-512),
    so its mean may be a few ulps off the exactly rounded one this code takes; the advantages differ by no
    more than that, and are bit-equal where the two means are."""
    rng = random.Random(0)
    num_equal = 0
    for trial in range(3000):
        n = rng.randint(1, 64)
        pick = trial % 3
        rewards = ([rng.uniform(-3.0, 3.0) for _ in range(n)] if pick == 0 else
                   [rng.randint(0, 7) / 7 - rng.uniform(0.0, 0.2) for _ in range(n)] if pick == 1 else  # reward-like
                   [rng.choice([0.0, 1 / 3, 2 / 3, 1.0, 0.1]) for _ in range(n)])  # ties
        ours, theirs = dr_grpo_advantages(rewards), _torch(rewards)
        bound = 2 * n * 2.0**-52 * max(abs(r) for r in rewards)
        assert all(abs(a - b) <= bound for a, b in zip(ours, theirs, strict=True)), rewards
        num_equal += ours == theirs
    assert num_equal > 0
