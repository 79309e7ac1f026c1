"""Admission under the staleness bound, and earliest-deadline-first batch selection."""

from __future__ import annotations

import pytest

from actors.reconciler.scheduling import AdmissionLimit, BatchWait, GroupView, SchedulingConfig, admission, select_batch


def admit(config: SchedulingConfig, **counts: int):
    base = dict(
        batch_size_groups=2,
        group_size=4,
        num_live_groups=0,
        num_ready_groups=0,
        num_inflight_rollouts=0,
        num_rollout_actors=4,
        num_free_slots=1000,
    )
    return admission(config, **{**base, **counts})


def test_areal_rule_bounds_live_groups() -> None:
    config = SchedulingConfig(eta=2, max_inflight_per_rollout_actor=100)
    assert admit(config) == admit(config, num_live_groups=0)
    assert admit(config).num_groups == 6  # (eta + 1) · B
    decision = admit(config, num_live_groups=5)
    assert (decision.num_groups, decision.limit) == (1, AdmissionLimit.STALENESS)
    assert admit(config, num_live_groups=6).num_groups == 0
    assert admit(SchedulingConfig(eta=0, max_inflight_per_rollout_actor=100)).num_groups == 2


def test_other_caps_bind() -> None:
    config = SchedulingConfig(eta=4, max_ready_groups=3, max_inflight_per_rollout_actor=2)
    assert admit(config, num_ready_groups=3).limit is AdmissionLimit.READY_CAP
    decision = admit(config, num_inflight_rollouts=4)  # cap 2 × 4 actors = 8: one group of 4 fits
    assert (decision.num_groups, decision.limit) == (1, AdmissionLimit.INFLIGHT_CAP)
    assert admit(config, num_rollout_actors=0).num_groups == 0
    assert admit(config, num_free_slots=7).limit is AdmissionLimit.SLOTS


def test_group_larger_than_whole_inflight_cap_still_runs_alone() -> None:
    config = SchedulingConfig(max_inflight_per_rollout_actor=1)
    assert admit(config, num_rollout_actors=1).num_groups == 1
    assert admit(config, num_rollout_actors=1, num_inflight_rollouts=4).num_groups == 0


def test_batch_is_earliest_deadline_first() -> None:
    groups = [GroupView(5, "late", True), GroupView(3, "early", True), GroupView(4, "mid", True)]
    decision = select_batch(groups, trainer_version=2, batch_size_groups=2, final=False)
    assert decision.group_ids == ("early", "mid")


def test_batch_waits_for_a_due_running_group() -> None:
    groups = [GroupView(4, "a", True), GroupView(4, "b", True), GroupView(2, "slow", False)]
    decision = select_batch(groups, trainer_version=2, batch_size_groups=2, final=False)
    assert decision == type(decision)((), BatchWait.DUE_GROUP_RUNNING, ("slow",))


def test_batch_waits_if_the_rest_could_not_make_their_deadlines() -> None:
    # after training a+b at v=2, three groups due by v=3 remain for one batch of 2
    groups = [GroupView(4, "a", True), GroupView(4, "b", True)] + [GroupView(3, f"r{i}", False) for i in range(3)]
    assert (
        select_batch(groups, trainer_version=2, batch_size_groups=2, final=False).wait is BatchWait.WOULD_MISS_DEADLINE
    )
    groups[2] = GroupView(3, "r0", True)
    assert select_batch(groups, trainer_version=2, batch_size_groups=2, final=False).wait is BatchWait.NONE


def test_short_final_batch_only_when_nothing_runs() -> None:
    ready = [GroupView(3, "a", True)]
    assert select_batch(ready, trainer_version=0, batch_size_groups=2, final=False).wait is BatchWait.NOT_ENOUGH_READY
    assert select_batch(ready, trainer_version=0, batch_size_groups=2, final=True).group_ids == ("a",)
    running = [*ready, GroupView(3, "b", False)]
    assert select_batch(running, trainer_version=0, batch_size_groups=2, final=True).group_ids == ()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eta": -1}, "'scheduling.eta' = -1 is outside its range"),
        ({"max_ready_groups": 0}, "max_ready_groups"),
        ({"rollout_timeout_s": 0}, "rollout_timeout_s"),
        ({"max_retries": -1}, "max_retries"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulingConfig(**kwargs)


def test_config_checked_against_table() -> None:
    with pytest.raises(ValueError, match="no batch could ever form"):
        SchedulingConfig(max_ready_groups=1).check_against(batch_size_groups=2, group_size=4)
    with pytest.raises(ValueError, match="min_group_survivors"):
        SchedulingConfig(min_group_survivors=5).check_against(batch_size_groups=2, group_size=4)
