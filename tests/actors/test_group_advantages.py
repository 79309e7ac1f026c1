"""The grouping stage's advantages: Dr. GRPO's of finite rewards; a group with a NaN or infinite reward is
refused, naming its samples (``[-inf, -inf]`` passed as a group without signal: issue 31)."""

from __future__ import annotations

import math

import pytest

from actors._stage import WorkRefused
from actors.records import RewardBreakdown, RewardRecord
from actors.stages.grouping import group_advantages


def _rewards(values: list[float]) -> list[RewardRecord]:
    return [RewardRecord(f"s{i}", "p0", f"samples/s{i}/a0", r, RewardBreakdown(0.0, 0, 1, 0.0, 0.0, 0, 0.0, r), ())
            for i, r in enumerate(values)]


def test_finite_rewards_get_dr_grpo_advantages() -> None:
    assert group_advantages("g0", _rewards([1.0, 0.0, 0.5])) == [0.5, -0.5, 0.0]
    assert group_advantages("g0", _rewards([0.1, 0.1, 0.1])) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("values", "named"), [
    ([-math.inf, -math.inf], ["s0", "s1"]),
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
