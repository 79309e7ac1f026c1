"""Scheduling policy of the lifecycle core: admission under the staleness bound, and batch selection.

Pure functions over counts and group views; `actors.reconciler.lifecycle.Lifecycle` feeds them and applies
their decisions. Everything here is live-configurable through `SchedulingConfig`.

Staleness (REFERENCES.md, "Asynchronous RL"): lag = trainer version − version of the oldest token.
A group whose oldest token has version m may be trained at trainer versions ≤ m + η: its
*deadline*. Before its rollouts finish, the version the rollout was issued at is a floor on m
(rollout actors must not generate with older weights), so every live group has a deadline.

Admission (AReaL): with B groups per batch, a new group may start only while
``trained + live + new ≤ (η + v + 1)·B``. Counting the groups in training as live and with one
batch trained per version this is ``live + new ≤ (η + 1)·B``, which is what `admission` checks.

Batch selection is earliest-deadline-first over READY groups, and a batch is handed out only if
every group due now is in it and the groups left behind can still all be trained in time, one batch
per version (`select_batch`). This is the anti-starvation rule: a long, hard prompt is never outrun
by short ones until it is too stale to train, and finished work is not discarded for staleness.
Only when nothing live is still running does it hand out the earliest-deadline batch regardless;
a group that then misses its deadline is dropped explicitly (counted and logged), never trained.

With ``cut_stragglers`` on, how long the trainer waits on a group due now is bounded, not by the
environment's slowest episode. With a batch's worth of other groups READY, a due group whose samples still roll out or
wait for their reward is named in the decision (`BatchDecision.due_running`); the lifecycle cuts
those samples (FAILED, a straggler past its group's last trainable version) and the group trains
its finished samples now, within the bound (``failed_group_policy``, ``min_group_survivors``), or
is dropped with its outcome recorded. Waiting instead holds every READY group and, through the
admission bound, every new admission behind one episode: under a heavy-tailed environment (a tool
or test suite whose p99 is 20x its median) that wait is most of an asynchronous run's wall time.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from runtime.config import Range, check_ranges, live

__all__ = [
    "AdmissionDecision",
    "AdmissionLimit",
    "BatchDecision",
    "BatchWait",
    "FailedGroupPolicy",
    "GroupView",
    "SchedulingConfig",
    "admission",
    "select_batch",
]


class FailedGroupPolicy(enum.StrEnum):
    DROP_GROUP = "drop_group"
    TRAIN_REST = "train_rest"


@dataclasses.dataclass(frozen=True)
class SchedulingConfig:
    """Live scheduling knobs (change at runtime with `Lifecycle.update_scheduling`).

    Attributes:
        eta: staleness bound η, in trainer versions.
        max_ready_groups: backpressure: no admission while this many groups are READY;
            None leaves only the staleness bound. Must be >= the batch size in groups.
        max_inflight_per_rollout_actor: rollouts in flight per live rollout actor.
        max_retries: retries per stage after a timeout, a lost actor or a failure; then FAILED.
            The train stage is different: timeouts are retried without bound and a rejection
            drops the batch at once (see `actors.reconciler.work.TrainOrder`).
        failed_group_policy: what a group with a FAILED sample does.
        min_group_survivors: TRAIN_REST trains a group only if this many samples survived.
        rollout_timeout_s, reward_timeout_s, group_timeout_s, train_timeout_s: seconds without a
            completion or heartbeat after which the stage's work is retried.
        train_partial_final_batch: when the dataset is exhausted and nothing else is running,
            hand out a batch of fewer than B groups.
        adopt_on_resume: a resumed core waits for the rollout and reward attempts in flight before it
            (their actors may be alive: their completions count) instead of re-issuing them all.
        adopt_grace_s: adopted work whose actor is not heard of (a heartbeat) within this many seconds
            is re-issued with a new attempt, not counted as a retry (actors beat every 5 s).
        cut_stragglers: with a batch's worth of other groups READY, fail the samples of a group due now that
            still roll out or wait for their reward, instead of holding the trainer for them (the bound on the
            wait below). Off by default: a cut group trains what finished or is dropped, its prompt not issued
            again, and an episode slowed by a fault (a frozen actor, a full store) would be cut as well as one
            slowed by its environment. Turn it on where a heavy-tailed environment, not faults, sets the pace.
    """

    eta: int = live(2, within=Range(0, 1000))
    max_ready_groups: int | None = live(None, within=Range(1, None))
    max_inflight_per_rollout_actor: int = live(8, within=Range(1, 100_000))
    max_retries: int = live(2, within=Range(0, 100))
    failed_group_policy: FailedGroupPolicy = live(FailedGroupPolicy.TRAIN_REST)
    min_group_survivors: int = live(2, within=Range(1, 4096))
    # without a completion or heartbeat (actors beat every 5 s)
    rollout_timeout_s: float = live(120.0, within=Range(0.0, None, lo_open=True))
    reward_timeout_s: float = live(120.0, within=Range(0.0, None, lo_open=True))
    group_timeout_s: float = live(60.0, within=Range(0.0, None, lo_open=True))
    train_timeout_s: float = live(600.0, within=Range(0.0, None, lo_open=True))
    train_partial_final_batch: bool = live(True)
    adopt_on_resume: bool = live(True)
    adopt_grace_s: float = live(12.0, within=Range(0.0, None, lo_open=True))
    cut_stragglers: bool = live(False)

    def __post_init__(self) -> None:
        check_ranges(self, "scheduling")
        object.__setattr__(self, "failed_group_policy", FailedGroupPolicy(self.failed_group_policy))

    def check_against(self, *, batch_size_groups: int, group_size: int) -> None:
        """Raise ValueError if this policy cannot work with the table's batch and group sizes."""
        if self.max_ready_groups is not None and self.max_ready_groups < batch_size_groups:
            raise ValueError(
                f"max_ready_groups={self.max_ready_groups} is below the batch size {batch_size_groups}: "
                "no batch could ever form; raise it or set None"
            )
        if self.min_group_survivors > group_size:
            raise ValueError(f"min_group_survivors={self.min_group_survivors} exceeds the group size {group_size}")


class AdmissionLimit(enum.StrEnum):
    """Which bound decided an admission (the smallest one)."""

    NONE = "none"
    STALENESS = "staleness"
    READY_CAP = "ready_cap"
    INFLIGHT_CAP = "inflight_cap"
    SLOTS = "slots"


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionDecision:
    num_groups: int
    limit: AdmissionLimit


def admission(
    config: SchedulingConfig,
    *,
    batch_size_groups: int,
    group_size: int,
    num_live_groups: int,
    num_ready_groups: int,
    num_inflight_rollouts: int,
    num_rollout_actors: int,
    num_free_slots: int,
) -> AdmissionDecision:
    """How many whole groups may start now, and which bound is binding.

    `num_live_groups` counts every admitted group not yet trained or dropped (in training included).
    """
    inflight_cap = config.max_inflight_per_rollout_actor * num_rollout_actors
    inflight_bound = (inflight_cap - num_inflight_rollouts) // group_size
    if inflight_bound <= 0 and num_inflight_rollouts == 0 and inflight_cap > 0:
        inflight_bound = 1  # a group larger than the whole cap still runs, alone
    bounds = {
        AdmissionLimit.STALENESS: (config.eta + 1) * batch_size_groups - num_live_groups,
        AdmissionLimit.READY_CAP: (
            math.inf if config.max_ready_groups is None or num_ready_groups < config.max_ready_groups else 0
        ),
        AdmissionLimit.INFLIGHT_CAP: inflight_bound,
        AdmissionLimit.SLOTS: num_free_slots // group_size,
    }
    limit, bound = min(bounds.items(), key=lambda item: item[1])
    return AdmissionDecision(max(0, int(bound)), limit)


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class GroupView:
    """What batch selection needs to know about a live group that is not in training."""

    deadline: int
    group_id: str
    ready: bool


class BatchWait(enum.StrEnum):
    """Why no batch was handed out."""

    NONE = "none"
    NOT_ENOUGH_READY = "not_enough_ready"
    DUE_GROUP_RUNNING = "due_group_running"
    WOULD_MISS_DEADLINE = "would_miss_deadline"


@dataclasses.dataclass(frozen=True, slots=True)
class BatchDecision:
    """A batch to hand out (`group_ids`), or why not (`wait`).

    Attributes:
        due_running: with `wait` DUE_GROUP_RUNNING, the groups due now that are not READY, while a
            batch's worth of other groups is: what the trainer would otherwise wait on.
    """

    group_ids: tuple[str, ...]
    wait: BatchWait
    due_running: tuple[str, ...] = ()


def _feasible(deadlines: Sequence[int], trainer_version: int, batch_size_groups: int) -> bool:
    """Can groups with these deadlines all be trained at versions v, v+1, ..., B per version?"""
    ordered = sorted(deadlines)
    return all(deadline >= trainer_version + i // batch_size_groups for i, deadline in enumerate(ordered))


def select_batch(
    groups: Sequence[GroupView],
    *,
    trainer_version: int,
    batch_size_groups: int,
    final: bool,
) -> BatchDecision:
    """Choose the next training batch (earliest deadline first) or say why to wait.

    Args:
        groups: live groups not in training, none past its deadline (drop those first).
        trainer_version: the version the batch will be trained at.
        batch_size_groups: B.
        final: the dataset is exhausted; a short batch is allowed once nothing else runs.
    """
    ready = sorted(g for g in groups if g.ready)
    running = [g for g in groups if not g.ready]
    if len(ready) < batch_size_groups and not (final and not running and ready):
        return BatchDecision((), BatchWait.NOT_ENOUGH_READY)
    batch = ready[:batch_size_groups]
    if not running:
        return BatchDecision(tuple(g.group_id for g in batch), BatchWait.NONE)
    due = tuple(g.group_id for g in sorted(running) if g.deadline <= trainer_version)
    if due:
        return BatchDecision((), BatchWait.DUE_GROUP_RUNNING, due)
    rest = [g.deadline for g in ready[batch_size_groups:]] + [g.deadline for g in running]
    if not _feasible(rest, trainer_version + 1, batch_size_groups):
        return BatchDecision((), BatchWait.WOULD_MISS_DEADLINE)
    return BatchDecision(tuple(g.group_id for g in batch), BatchWait.NONE)
