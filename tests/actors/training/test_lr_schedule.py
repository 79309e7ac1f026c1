"""The learning-rate schedule: its values per version, the fallback without a step budget, validation."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from actors.config import TrainerSection
from actors.training.lr_schedule import LRSchedule


def test_cosine_runs_from_the_peak_at_version_0_to_the_minimum_at_the_last_step() -> None:
    schedule = LRSchedule("cosine", peak=3e-4, min_ratio=0.1, num_steps=71)  # steps at versions 0..70
    assert schedule.lr_at(0) == pytest.approx(3e-4, rel=1e-12)
    # Halfway (version 35 of 0..70): the cosine is at 0, the lr halfway between peak and minimum.
    assert schedule.lr_at(35) == pytest.approx(3e-4 * (0.1 + 0.9 * 0.5), rel=1e-12)
    assert schedule.lr_at(70) == pytest.approx(3e-5, rel=1e-12)
    # Every version of a short run against a hand-written cosine.
    short = LRSchedule("cosine", peak=1.0, min_ratio=0.0, num_steps=5)  # last step at version 4
    assert [short.lr_at(v) for v in range(5)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * v / 4)) for v in range(5)], abs=1e-15
    )


def test_cosine_stays_at_its_minimum_past_the_last_step() -> None:
    schedule = LRSchedule("cosine", peak=2e-4, min_ratio=0.25, num_steps=10)
    assert schedule.lr_at(9) == schedule.lr_at(10) == schedule.lr_at(1000) == pytest.approx(5e-5, rel=1e-12)


@given(st.integers(2, 500), st.floats(0.0, 1.0), st.data())
def test_cosine_never_rises_and_stays_between_minimum_and_peak(num_steps: int, min_ratio: float, data) -> None:
    schedule = LRSchedule("cosine", peak=1e-3, min_ratio=min_ratio, num_steps=num_steps)
    v = data.draw(st.integers(0, num_steps + 5))
    assert 1e-3 * min_ratio * (1 - 1e-12) <= schedule.lr_at(v) <= 1e-3 * (1 + 1e-12)
    assert schedule.lr_at(v + 1) <= schedule.lr_at(v) * (1 + 1e-12)


def test_constant_is_the_peak_at_every_version() -> None:
    schedule = LRSchedule("constant", peak=2e-4, min_ratio=0.1, num_steps=70)
    assert {schedule.lr_at(v) for v in (0, 35, 69, 70, 500)} == {2e-4}


def test_a_new_peak_rescales_the_schedule_and_keeps_its_shape() -> None:
    schedule = LRSchedule("cosine", peak=3e-4, min_ratio=0.1, num_steps=70)
    lower = schedule.with_peak(1e-4)
    for v in (0, 20, 40, 69):
        assert lower.lr_at(v) == pytest.approx(schedule.lr_at(v) / 3, rel=1e-12)


def test_cosine_without_a_step_budget_falls_back_to_constant_and_says_so() -> None:
    with capture_logs() as logs:
        schedule = LRSchedule.for_run("cosine", 3e-4, 0.1, num_steps=0)
    assert schedule.kind == "constant" and schedule.lr_at(0) == schedule.lr_at(100) == 3e-4
    assert [e["event"] for e in logs] == ["lr_schedule_constant_fallback"]
    assert logs[0]["requested"] == "cosine"
    with capture_logs() as logs:
        assert LRSchedule.for_run("cosine", 3e-4, 0.1, num_steps=70).kind == "cosine"
        assert LRSchedule.for_run("constant", 3e-4, 0.1, num_steps=0).kind == "constant"
    assert logs == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "linear", "peak": 1e-4}, "kind='linear'"),
        ({"kind": "constant", "peak": 0.0}, "peak=0.0"),
        ({"kind": "cosine", "peak": 1e-4, "min_ratio": 1.5, "num_steps": 10}, "min_ratio=1.5"),
        ({"kind": "cosine", "peak": 1e-4, "num_steps": 0}, "num_steps >= 1"),
    ],
)
def test_invalid_schedules_are_refused_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LRSchedule(**kwargs)


def test_the_trainer_section_validates_its_schedule_keys() -> None:
    unknown = re.escape("kind='cos': use one of constant, cosine (trainer.lr_schedule='cos'")
    with pytest.raises(ValueError, match=unknown):
        TrainerSection(lr_schedule="cos")
    # the keys' declared ranges refuse these before the schedule sees them, naming the key
    with pytest.raises(ValueError, match=re.escape("'trainer.lr_min_ratio' = -0.1 is outside its range [0, 1]")):
        TrainerSection(lr_min_ratio=-0.1)
    with pytest.raises(ValueError, match=re.escape("'trainer.lr' = 0.0 is outside its range (0, 1]")):
        TrainerSection(lr=0.0)
