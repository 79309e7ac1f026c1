"""Wire names of everything the RL actors say to each other over NATS (through the reconciler).

The work orders and completions are the lifecycle core's own dataclasses (actors.reconciler.work);
this module only names them on the wire. One codec type set per direction keeps decoding strict: a
rollout actor that receives a train order dead-letters it instead of guessing.
"""

from __future__ import annotations

from typing import Any

from actors.reconciler.slot import Stage
from actors.reconciler.work import (
    GroupDone,
    GroupOrder,
    RewardDone,
    RewardGroupDone,
    RewardGroupOrder,
    RewardOrder,
    RolloutDone,
    RolloutGroupDone,
    RolloutGroupOrder,
    RolloutOrder,
    StageFailed,
    TrainDone,
    TrainOrder,
)
from runtime.bus import DONE_QUEUE, Queue, work_queue
from runtime.codec import message

RECONCILER_KIND = "reconciler"  # the one kind that issues orders and answers the stages' heartbeats

ORDER_TYPES: dict[Stage, tuple[str, type]] = {
    Stage.ROLLOUT: ("order.rollout", RolloutOrder),
    Stage.REWARD: ("order.reward", RewardOrder),
    Stage.GROUP: ("order.group", GroupOrder),
    Stage.TRAIN: ("order.train", TrainOrder),
}
# A group's rollout (reward) orders travel as one message: the form the reconciler sends and the
# stage base fans out; the single orders above stay accepted (the stage base does either).
GROUP_ORDER_TYPES: dict[Stage, tuple[str, type]] = {
    Stage.ROLLOUT: ("order.rollout_group", RolloutGroupOrder),
    Stage.REWARD: ("order.reward_group", RewardGroupOrder),
}
COMPLETION_TYPES: dict[str, type] = {
    "done.rollout": RolloutDone,
    "done.reward": RewardDone,
    "done.rollout_group": RolloutGroupDone,
    "done.reward_group": RewardGroupDone,
    "done.group": GroupDone,
    "done.train": TrainDone,
    "done.failed": StageFailed,
}


def work_queue_of(stage: Stage) -> Queue:
    return work_queue(stage.value)


def order_types(stage: Stage) -> dict[str, type]:
    name, cls = ORDER_TYPES[stage]
    grouped = [GROUP_ORDER_TYPES[stage]] if stage in GROUP_ORDER_TYPES else []
    return {name: cls, **dict(grouped)}


def all_order_types() -> dict[str, type]:
    return {name: cls for name, cls in (*ORDER_TYPES.values(), *GROUP_ORDER_TYPES.values())}


def done_subject(stage: Stage) -> str:
    return f"done.{stage.value}"


def stages_spoken_for(completion: Any) -> set[Stage]:
    """The stages whose work a completion (or a group's answer) reports on: a `StageFailed` names its
    own, a group's answer those of its items' failures beside its own, every other completion its type's."""
    if isinstance(completion, StageFailed):
        return {completion.stage}
    return {completion.STAGE, *(failed.stage for failed in getattr(completion, "failed", ()))}


def why_not_from_subject(completion: Any, subject: str) -> str | None:
    """Why `completion` is not believed from ``subject`` (None: it is): only a stage's role may publish on
    its ``done.<stage>`` (the server's permissions), so a completion is believed only on its own stage's
    subject; on another's it is a role reporting work it was never given (a stolen token, say)."""
    stages = stages_spoken_for(completion)
    wrong = sorted(s.value for s in stages if done_subject(s) != subject)
    if not wrong:
        return None
    return (f"{type(completion).__name__} reports on stage {'/'.join(wrong)} but arrived on {subject!r}: only "
            f"{'/'.join(done_subject(Stage(w)) for w in wrong)} may carry it (its stage's role alone publishes there)")


@message("weights.published")
class WeightsPublished:
    """The trainer published policy ``version``; its state is at ``key`` in blob storage."""

    run: str
    version: int
    key: str
    num_bytes: int


@message("run.data_exhausted")
class DataExhausted:
    """Every prompt of run ``run``'s last epoch was trained or dropped: ``version`` is the last policy.

    The reconciler says so on every tick from then on (a restarted listener hears it within a tick)."""

    run: str
    version: int


def data_exhausted_subject(run: str) -> str:
    return f"data_exhausted.{run}"


@message("heartbeat.work")
class WorkHeartbeat:
    """A stage actor is still working on (stage, key, attempt), issued with `token`: the reconciler
    keeps it alive (only with the order's token: nobody else can keep work from timing out)."""

    stage: Stage
    key: str
    attempt: int
    actor_id: str
    token: str


@message("heartbeat.work_group")
class WorkHeartbeats:
    """Heartbeats of the items of one group order, in one message (each judged on its own token)."""

    beats: tuple[WorkHeartbeat, ...]


def heartbeat_subject(stage: Stage) -> str:
    return f"heartbeat.{stage.value}"


def why_beat_not_from_subject(beat: WorkHeartbeat, subject: str) -> str | None:
    """Why a heartbeat is not believed from ``subject`` (None: it is): like a completion, a stage's
    heartbeat keeps only that stage's work alive, and only its role publishes on ``heartbeat.<stage>``."""
    if heartbeat_subject(beat.stage) == subject:
        return None
    return (f"a heartbeat for stage {beat.stage.value} arrived on {subject!r}: only "
            f"{heartbeat_subject(beat.stage)!r} may carry it")


__all__ = [
    "COMPLETION_TYPES",
    "DONE_QUEUE",
    "GROUP_ORDER_TYPES",
    "ORDER_TYPES",
    "RECONCILER_KIND",
    "DataExhausted",
    "WeightsPublished",
    "WorkHeartbeat",
    "WorkHeartbeats",
    "all_order_types",
    "data_exhausted_subject",
    "done_subject",
    "heartbeat_subject",
    "order_types",
    "stages_spoken_for",
    "why_beat_not_from_subject",
    "why_not_from_subject",
    "work_queue_of",
]
