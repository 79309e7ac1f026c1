"""The work in flight: which (stage, key) was issued with which attempt and token, and the orders to publish.

A completion or heartbeat counts only if it names the attempt and the issuance token of the work in
flight now (`Issuance.is_issued`); an older attempt is a stale report (ignored, counted), anything else
a forgery (rejected, counted, logged). Orders are built here from the slots they concern and collected
until the core call that made them returns them.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator

import structlog

from actors.reconciler.metrics import LifecycleMetrics
from actors.reconciler.slot import Slot, SlotState, Stage
from actors.reconciler.table import TableGroup, TrainBatch
from actors.reconciler.work import GroupOrder, RewardOrder, RolloutOrder, TrainOrder, WorkOrder

__all__ = ["Issuance", "IssuedWork"]

log = structlog.get_logger(__name__)


@dataclasses.dataclass(slots=True)
class IssuedWork:
    attempt: int
    last_seen: float
    actor_id: str = ""
    token: str = ""
    adopted: bool = False  # issued before a resume and not heard of since (see `Issuance.adopt`)


class Issuance:
    """The issued work, keyed by (stage, key), and the orders issued since the last `take_orders`."""

    def __init__(self, metrics: LifecycleMetrics) -> None:
        self._metrics = metrics
        # in the order each was last heard of (issued, or a heartbeat: moved to the end), so that `timed_out`
        # reads the oldest only, not every unit of a table of 10^5 slots on every tick
        self._work: dict[tuple[Stage, str], IssuedWork] = {}
        self._adopted: set[tuple[Stage, str]] = set()  # the adopted units not heard of since (`unconfirmed`)
        self._out: list[WorkOrder] = []

    # ------------------------------------------------------------------ issuing
    def issue(self, order: WorkOrder, now: float) -> None:
        unit = (order.STAGE, order.key)
        self._work.pop(unit, None)
        self._adopted.discard(unit)
        self._work[unit] = IssuedWork(order.attempt, now, token=order.token)
        self._out.append(order)

    def adopt(self, slot: Slot, now: float) -> None:
        """Wait again for the attempt a slot in ROLLOUT or REWARD holds, issued before this core existed:
        its actor may still be working on it (nothing is published; its completion counts as any other).
        Until the actor is heard of (a heartbeat with the token), it is `unconfirmed`."""
        unit = (Stage(slot.state.value), slot.sample_id)
        self._work.pop(unit, None)
        self._work[unit] = IssuedWork(slot.attempt, now, token=slot.token, adopted=True)
        self._adopted.add(unit)

    def unconfirmed(self, now: float, grace_s: float) -> list[tuple[Stage, str]]:
        """Adopted work not heard of within ``grace_s`` of its adoption: no live actor holds it."""
        return [unit for unit in self._adopted if now - self._work[unit].last_seen > grace_s]

    def take_orders(self) -> list[WorkOrder]:
        orders, self._out = self._out, []
        return orders

    def issue_sample(self, slot: Slot, now: float) -> None:
        """The rollout or reward order of a slot in ROLLOUT or REWARD."""
        if slot.state is SlotState.ROLLOUT:
            order: WorkOrder = RolloutOrder(
                slot.sample_id,
                slot.attempt,
                slot.prompt_id,
                slot.group_id,
                slot.index_in_group,
                slot.issued_version,
                slot.token,
            )
        else:
            order = RewardOrder(
                slot.sample_id, slot.attempt, slot.prompt_id, slot.group_id, slot.blob_keys["rollout"], slot.token
            )
        self.issue(order, now)

    def issue_group(self, group: TableGroup, alive: list[Slot], now: float) -> None:
        alive = sorted(alive, key=lambda s: s.index_in_group)
        self.issue(
            GroupOrder(
                group.group_id,
                max(s.attempt for s in alive),
                group.prompt_id,
                tuple(s.sample_id for s in alive),
                tuple(s.blob_keys["reward"] for s in alive),
                alive[0].token,  # a group's order carries its first surviving member's token
            ),
            now,
        )

    def issue_batch(self, batch: TrainBatch, groups: list[list[Slot]], deadline_version: int, now: float) -> None:
        """The train order of `batch`; `groups` are its groups' members, in the batch's order."""
        members = [s for g in groups for s in sorted(g, key=lambda s: s.index_in_group)]
        self.issue(
            TrainOrder(
                batch.batch_id,
                max(s.attempt for s in members),
                batch.group_ids,
                tuple(g[0].blob_keys["group"] for g in groups),
                tuple(s.sample_id for s in members),
                batch.trainer_version,
                deadline_version,
                members[0].token,  # a batch's order carries its first member's token
            ),
            now,
        )

    # ------------------------------------------------------------------ reports
    def is_issued(self, stage: Stage, key: str, attempt: int, token: str, what: str = "completion") -> bool:
        """Whether (stage, key, attempt, token) is the work in flight now. An older attempt is a stale
        (redelivered, superseded) report: ignored and counted. The current or a future attempt with
        another token was never issued by this table: a forgery, rejected, counted and logged."""
        issued = self._work.get((stage, key))
        # bytes: compare_digest refuses str with non-ASCII characters, and a token comes off the wire
        if issued is not None and issued.attempt == attempt and secrets.compare_digest(
            issued.token.encode(), token.encode()
        ):
            return True
        if issued is None or attempt < issued.attempt:
            if what != "heartbeat":  # an actor still busy with a superseded attempt beats on: normal
                self._metrics.counters["ignored_completions"] += 1
            return False
        self._metrics.counters["rejected_reports"] += 1
        reason = "token does not match the issued one" if attempt == issued.attempt else "attempt never issued"
        log.warning("report_rejected", what=what, stage=stage.value, key=key, attempt=attempt,
                    issued_attempt=issued.attempt, reason=reason)
        return False

    def heartbeat(self, stage: Stage, key: str, attempt: int, actor_id: str, token: str, now: float) -> None:
        if self.is_issued(stage, key, attempt, token, "heartbeat"):
            unit = (stage, key)
            issued = self._work.pop(unit)
            self._work[unit] = issued  # heard of now: the newest
            issued.last_seen = max(issued.last_seen, now)
            issued.actor_id = actor_id
            issued.adopted = False
            self._adopted.discard(unit)

    def is_current(self, stage: Stage, key: str, attempt: int) -> bool:
        issued = self._work.get((stage, key))
        return issued is not None and issued.attempt == attempt

    def is_pending(self, stage: Stage, key: str) -> bool:
        return (stage, key) in self._work

    def withdraw(self, stage: Stage, key: str) -> None:
        """Nothing is waited for on (stage, key) any more (done, retried or dropped)."""
        self._work.pop((stage, key), None)
        self._adopted.discard((stage, key))

    def held_by(self, actor_id: str) -> list[tuple[Stage, str]]:
        return [unit for unit, issued in self._work.items() if issued.actor_id == actor_id]

    def timed_out(self, now: float, timeout_s: Callable[[Stage], float]) -> Iterator[tuple[Stage, str, float]]:
        """(stage, key, idle seconds) of the work not heard of for longer than its stage's timeout: read from
        the oldest, up to the first unit heard of within the shortest timeout (the rest are newer)."""
        shortest = min(timeout_s(stage) for stage in Stage)
        late = []
        for unit, w in self._work.items():
            idle = now - w.last_seen
            if idle <= shortest:
                break
            if not w.adopted and idle > timeout_s(unit[0]):
                late.append((unit, idle))
        for (stage, key), idle in late:
            yield stage, key, idle
