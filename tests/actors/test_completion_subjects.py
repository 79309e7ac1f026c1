"""A completion (or heartbeat) is believed only on its own stage's subject: the server lets only a stage's role
publish on ``done.<stage>`` and ``heartbeat.<stage>``, so a report of another stage's work arriving there is a
role speaking for work it was never given (with a stolen token it could move a slot, drop a batch and jump the
trainer's version, all from ``done.rollout``)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.messages import (
    COMPLETION_TYPES,
    WorkHeartbeat,
    done_subject,
    heartbeat_subject,
    why_beat_not_from_subject,
    why_not_from_subject,
)
from actors.reconciler.slot import Stage
from actors.reconciler.work import (
    GroupDone,
    RewardDone,
    RewardGroupDone,
    RolloutDone,
    RolloutGroupDone,
    StageFailed,
    TrainDone,
)

TOKEN = "t" * 16
ONE_OF_EACH: list[tuple[Any, Stage]] = [
    (RolloutDone("s", 0, "k", 0, 0, TOKEN), Stage.ROLLOUT),
    (RewardDone("s", 0, "k", TOKEN), Stage.REWARD),
    (GroupDone("g", 0, "k", TOKEN), Stage.GROUP),
    (TrainDone("b", 0, 56, TOKEN), Stage.TRAIN),
    *[(StageFailed(stage, "k", 0, "r", TOKEN), stage) for stage in Stage],
    (RolloutGroupDone("g", (RolloutDone("s", 0, "k", 0, 0, TOKEN),), (StageFailed(Stage.ROLLOUT, "s2", 0, "r"),)),
     Stage.ROLLOUT),
    (RewardGroupDone("g", (RewardDone("s", 0, "k", TOKEN),)), Stage.REWARD),
]


def test_every_completion_type_is_covered() -> None:
    assert {type(c) for c, _ in ONE_OF_EACH} == set(COMPLETION_TYPES.values())


@pytest.mark.parametrize(("completion", "own"), ONE_OF_EACH, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("subject_stage", list(Stage), ids=lambda s: s.value)
def test_a_completion_is_believed_only_on_its_stage_s_subject(completion: Any, own: Stage,
                                                             subject_stage: Stage) -> None:
    why = why_not_from_subject(completion, done_subject(subject_stage))
    if subject_stage is own:
        assert why is None
    else:
        assert why is not None and own.value in why and done_subject(own) in why


@pytest.mark.parametrize("foreign", [Stage.REWARD, Stage.GROUP, Stage.TRAIN])
def test_a_group_answer_carrying_another_stage_s_failure_is_refused_whole(foreign: Stage) -> None:
    answer = RolloutGroupDone("g", (RolloutDone("s", 0, "k", 0, 0, TOKEN),), (StageFailed(foreign, "b1", 0, "x"),))
    why = why_not_from_subject(answer, done_subject(Stage.ROLLOUT))
    assert why is not None and foreign.value in why


def test_subjects_that_are_no_stage_s_are_refused() -> None:
    for subject in ("done", "done.", "done.rollout.x", "done.>", "done.failed", "done.*"):
        assert why_not_from_subject(RolloutDone("s", 0, "k", 0, 0), subject) is not None


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_a_heartbeat_is_believed_only_on_its_stage_s_subject(stage: Stage) -> None:
    beat = WorkHeartbeat(stage, "k", 0, "a", TOKEN)
    for subject_stage in Stage:
        why = why_beat_not_from_subject(beat, heartbeat_subject(subject_stage))
        assert (why is None) is (subject_stage is stage)
