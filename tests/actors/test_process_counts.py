"""Process counts a kind cannot take are refused when the run file is read: two trainers would read one
queue and train diverging policies, so trainer.count > 1 is an error that points to actors.trainer.ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.errors import ConfigError
from runtime.run_config import load_run_config

RUN_FILE = Path(__file__).resolve().parents[2] / "actors" / "run.toml"


@pytest.mark.parametrize("count", [2, 3, 100])
def test_more_than_one_trainer_is_refused_pointing_to_ranks(count: int) -> None:
    with pytest.raises(ConfigError, match=rf"actors\.trainer\.count={count}.*actors\.trainer\.ranks = N"):
        load_run_config([RUN_FILE], [f"actors.trainer.count={count}"])


@pytest.mark.parametrize("count", [0, 1])
def test_zero_or_one_trainer_is_accepted(count: int) -> None:
    cfg = load_run_config([RUN_FILE], [f"actors.trainer.count={count}"])
    assert cfg.runtime.actors["trainer"].count == count


def test_kinds_without_a_limit_take_any_count() -> None:
    assert load_run_config([RUN_FILE], ["actors.rollout.count=3"]).runtime.actors["rollout"].count == 3


def test_ranks_for_a_kind_that_is_not_a_process_group_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"actors\.rollout\.ranks=2: RolloutActor does not run as a group"):
        load_run_config([RUN_FILE], ["actors.rollout.ranks=2"])


def test_a_malformed_device_is_refused_when_the_config_is_read() -> None:
    with pytest.raises(ConfigError, match=r"policy\.device='gpu'"):
        load_run_config([RUN_FILE], ["policy.device=gpu"])


def test_the_trainer_takes_ranks() -> None:
    cfg = load_run_config([RUN_FILE], ["actors.trainer.ranks=4", "trainer.expert_parallel=2"])
    assert cfg.runtime.actors["trainer"].ranks == 4 and cfg.app.trainer.expert_parallel == 2
