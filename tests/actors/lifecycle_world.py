"""A scripted world around the lifecycle core: stage actors and a trainer, driven step by step.

Used by the property tests. Results travel through a fake blob store the way they do in the real
system: a rollout's key names its token versions, a reward's key names its rollout, a group's key
names its rewards, so the fake trainer recomputes staleness from the data it would load, not from
the core's own bookkeeping.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from actors import (
    GroupDone,
    GroupOrder,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    StageFailed,
    TrainDone,
    TrainOrder,
    WorkOrder,
)
from actors.reconciler.work import Completion, bound_to


class TrainedTwice(AssertionError):
    pass


class StalenessExceeded(AssertionError):
    pass


@dataclasses.dataclass
class FakeTrainer:
    """Trains each batch id at most once (as the real trainer must) and checks staleness itself."""

    version: int = 0
    trained_batches: dict[str, int] = dataclasses.field(default_factory=dict)
    rejected_batches: dict[str, str] = dataclasses.field(default_factory=dict)
    trained_samples: set[str] = dataclasses.field(default_factory=set)
    trained_groups: set[str] = dataclasses.field(default_factory=set)
    max_lag_seen: int = 0

    def reject(self, order: TrainOrder, reason: str) -> Completion:
        if order.batch_id in self.trained_batches:
            return TrainDone(order.batch_id, order.attempt, self.trained_batches[order.batch_id])
        self.rejected_batches.setdefault(order.batch_id, reason)
        return StageFailed(order.STAGE, order.batch_id, order.attempt, self.rejected_batches[order.batch_id])

    def train(self, order: TrainOrder, blobs: dict[str, object], eta: int) -> Completion:
        if order.batch_id in self.trained_batches or order.batch_id in self.rejected_batches:
            return self.reject(order, "")
        if self.version > order.deadline_version:
            return self.reject(order, "deadline passed")
        for group_id, group_key in zip(order.group_ids, order.group_keys, strict=True):
            if group_id in self.trained_groups:
                raise TrainedTwice(f"group {group_id} trained twice (batch {order.batch_id})")
            self.trained_groups.add(group_id)
            for reward_key in blobs[group_key]:  # type: ignore[attr-defined]
                sample_id, min_version = blobs[blobs[reward_key]]  # type: ignore[index]
                lag = self.version - min_version
                if lag > eta:
                    raise StalenessExceeded(f"{sample_id}: lag {lag} > eta {eta} at version {self.version}")
                self.max_lag_seen = max(self.max_lag_seen, lag)
                if sample_id in self.trained_samples:
                    raise TrainedTwice(f"sample {sample_id} trained twice (batch {order.batch_id})")
                self.trained_samples.add(sample_id)
        self.version += 1
        self.trained_batches[order.batch_id] = self.version
        return TrainDone(order.batch_id, order.attempt, self.version)


@dataclasses.dataclass
class World:
    """Outstanding work (including stale attempts), delivered completions and the blob store."""

    trainer: FakeTrainer = dataclasses.field(default_factory=FakeTrainer)
    pending: list[WorkOrder] = dataclasses.field(default_factory=list)
    delivered: list[Completion] = dataclasses.field(default_factory=list)
    blobs: dict[str, object] = dataclasses.field(default_factory=dict)
    eta_at_issue: dict[str, int] = dataclasses.field(default_factory=dict)
    issued: Counter[str] = dataclasses.field(default_factory=Counter)

    def add(self, orders: list[WorkOrder] | tuple[WorkOrder, ...], eta: int) -> None:
        for order in orders:
            self.issued[order.msg_id] += 1
            self.eta_at_issue[order.msg_id] = eta
            self.pending.append(order)

    def take(self, index: int) -> WorkOrder:
        return self.pending.pop(index % len(self.pending))

    def complete(self, order: WorkOrder, version_offset: int = 0) -> Completion:
        """The successful completion a stage actor would report for `order` (with its token)."""
        return bound_to(self._result(order, version_offset), order)

    def _result(self, order: WorkOrder, version_offset: int) -> Completion:
        match order:
            case RolloutOrder():
                version = min(order.policy_version_floor + version_offset, self.trainer.version)
                version = max(version, order.policy_version_floor)
                key = f"traj/{order.sample_id}/{order.attempt}"
                self.blobs[key] = (order.sample_id, version)
                return RolloutDone(order.sample_id, order.attempt, key, version, max(version, self.trainer.version))
            case RewardOrder():
                key = f"reward/{order.sample_id}/{order.attempt}"
                self.blobs[key] = order.rollout_key
                return RewardDone(order.sample_id, order.attempt, key)
            case GroupOrder():
                key = f"group/{order.group_id}/{order.attempt}"
                self.blobs[key] = order.reward_keys
                return GroupDone(order.group_id, order.attempt, key)
            case TrainOrder():
                return self.trainer.train(order, self.blobs, self.eta_at_issue[order.msg_id])
        raise TypeError(order)

    def failure(self, order: WorkOrder, reason: str = "injected failure") -> Completion:
        """What an actor reports when it gives up on `order`.

        A trainer decides a batch id once: a trained batch is answered with TrainDone, a rejected
        one is rejected for good (see `TrainOrder`).
        """
        if isinstance(order, TrainOrder):
            return bound_to(self.trainer.reject(order, reason), order)
        return bound_to(StageFailed(order.STAGE, order.key, order.attempt, reason), order)
