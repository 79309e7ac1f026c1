"""The slot table underneath `actors.lifecycle.Lifecycle`: in-memory mirror of the store, writes, bookkeeping.

Private: `Lifecycle` adds the events, scheduling and resume on top. Every slot write goes through
`SlotTable._write` (compare-and-set, then the in-memory indexes), every order through `_issue`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import structlog

from actors.lifecycle_events import (
    GroupOrder,
    GroupOutcome,
    MetaRecord,
    RewardOrder,
    RolloutOrder,
    TrainOrder,
    WorkOrder,
)
from actors.lifecycle_metrics import LifecycleMetrics
from actors.slot_store import META_KEY, SLOT_PREFIX, SlotStore, outcome_key, slot_key
from actors.slots import SampleLifecycleError, Slot, SlotState, Stage
from actors.task_cursor import TaskCursor

if TYPE_CHECKING:
    from actors.lifecycle import LifecycleConfig

__all__ = ["CoreBroken", "IssuedWork", "SlotTable", "TableGroup", "TrainBatch", "load_slots"]

log = structlog.get_logger(__name__)
T = TypeVar("T")


class CoreBroken(SampleLifecycleError, RuntimeError):
    """An earlier call failed part-way; this core may disagree with the store. Resume a new one."""


@dataclasses.dataclass(slots=True)
class TableGroup:
    group_id: str
    prompt_id: str
    epoch: int
    position: int
    members: list[int]


@dataclasses.dataclass(slots=True)
class IssuedWork:
    attempt: int
    last_seen: float
    actor_id: str = ""
    token: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class TrainBatch:
    batch_id: str
    group_ids: tuple[str, ...]
    trainer_version: int


class SlotTable:
    """S slots mirrored from the store, the groups and work they imply, and the write discipline."""

    def __init__(
        self,
        config: LifecycleConfig,
        store: SlotStore,
        cursor: TaskCursor,
        slots: list[Slot],
        revisions: list[int],
        meta: MetaRecord,
        meta_revision: int,
    ) -> None:
        self._config = config
        self._scheduling = config.scheduling
        self._store = store
        self._cursor = cursor
        self._slots = slots
        self._revs = revisions
        self._version = meta.trainer_version
        self._meta = meta
        self._meta_rev = meta_revision
        self._counts: Counter[SlotState] = Counter(s.state for s in slots)
        self._by_sample = {s.sample_id: s.index for s in slots if s.is_live}
        self._free = [s.index for s in slots if not s.is_live]
        heapq.heapify(self._free)
        self._groups: dict[str, TableGroup] = {}
        self._ready: set[str] = set()
        self._work: dict[tuple[Stage, str], IssuedWork] = {}
        self._batch: TrainBatch | None = None
        self._num_rollout_actors = 0
        self._out: list[WorkOrder] = []
        self._now = 0.0
        self._lock = asyncio.Lock()
        self._broken = False
        self._log_allowance = 0.0
        self._log_last = 0.0
        self._log_suppressed = 0
        self.metrics = LifecycleMetrics(window_s=config.metrics_window_s)

    # ------------------------------------------------------------------ call discipline
    async def _run(self, now: float, body: Callable[[], Awaitable[None]]) -> list[WorkOrder]:
        await self._guarded(now, body)
        orders, self._out = self._out, []
        return orders

    async def _guarded(self, now: float, body: Callable[[], Awaitable[T]]) -> T:
        if self._broken:
            raise CoreBroken("an earlier call on this lifecycle core failed; resume a new core from the store")
        async with self._lock:
            self._now = max(self._now, now)
            try:
                return await body()
            except BaseException:
                self._broken = True
                raise

    # ------------------------------------------------------------------ writes
    async def _write(self, new: Slot) -> None:
        i = new.index
        old = self._slots[i]
        self._revs[i] = await self._store.update(slot_key(i), new.encode(), self._revs[i])
        self._slots[i] = new
        self._counts[old.state] -= 1
        self._counts[new.state] += 1
        if old.sample_id and old.sample_id != new.sample_id:
            self._by_sample.pop(old.sample_id, None)
        if new.sample_id:
            self._by_sample[new.sample_id] = i
        if old.is_live and not new.is_live:
            heapq.heappush(self._free, i)
        self.metrics.counters["transitions"] += 1
        self._log_transition(old, new)

    async def _write_all(self, slots: Iterable[Slot]) -> None:
        # One after another: with the reconciler's group-commit store a write only joins a buffer,
        # and a task per write (gather) cost more than the write itself.
        for slot in slots:
            await self._write(slot)

    async def _put_outcome(self, outcome: GroupOutcome) -> None:
        key = outcome_key(outcome.group_id)
        entry = await self._store.get(key)
        if entry is None:
            await self._store.create(key, outcome.encode())
            return
        earlier = GroupOutcome.decode(entry.value)
        merged = dataclasses.replace(outcome, failed_samples={**earlier.failed_samples, **outcome.failed_samples})
        await self._store.update(key, merged.encode(), entry.revision)

    async def _save_meta(self, version: int, batch: TrainBatch | None) -> None:
        meta = MetaRecord(version)
        if batch is not None:
            meta = MetaRecord(version, batch.batch_id, batch.group_ids, batch.trainer_version)
        self._meta_rev = await self._store.update(META_KEY, meta.encode(), self._meta_rev)
        self._meta = meta
        self._version = version

    async def _set_version(self, version: int) -> None:
        if version > self._version:
            await self._save_meta(version, self._batch)
            await self._drop_stale()
        await self._pump()

    def _log_transition(self, old: Slot, new: Slot) -> None:
        rate = self._config.transition_events_per_s
        if rate == 0:
            return
        self._log_allowance = min(rate, self._log_allowance + (self._now - self._log_last) * rate)
        self._log_last = self._now
        if self._log_allowance < 1.0:
            self._log_suppressed += 1
            return
        self._log_allowance -= 1.0
        sample = new if new.is_live else old
        log.info(
            "slot_transition",
            slot=new.index,
            sample_id=sample.sample_id,
            from_state=old.state.value,
            to_state=new.state.value,
            attempt=new.attempt,
            policy_version=self._version,
            num_suppressed=self._log_suppressed,
        )
        self._log_suppressed = 0

    # ------------------------------------------------------------------ work bookkeeping
    def _timeout(self, stage: Stage) -> float:
        return getattr(self._scheduling, f"{stage.value}_timeout_s")

    def _issue(self, order: WorkOrder) -> None:
        self._work[(order.STAGE, order.key)] = IssuedWork(order.attempt, self._now, token=order.token)
        self._out.append(order)

    def _is_issued(self, stage: Stage, key: str, attempt: int, token: str, what: str = "completion") -> bool:
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
                self.metrics.counters["ignored_completions"] += 1
            return False
        self.metrics.counters["rejected_reports"] += 1
        reason = "token does not match the issued one" if attempt == issued.attempt else "attempt never issued"
        log.warning("report_rejected", what=what, stage=stage.value, key=key, attempt=attempt,
                    issued_attempt=issued.attempt, reason=reason)
        return False

    def _finish(self, stage: Stage, key: str, started: float) -> None:
        self._work.pop((stage, key), None)
        self.metrics.record_latency(stage.value, self._now - started)

    def _members(self, group: TableGroup) -> list[Slot]:
        return [self._slots[i] for i in group.members]

    def _alive(self, group: TableGroup) -> list[Slot]:
        return [s for s in self._members(group) if s.state is not SlotState.FAILED]

    def _deadline(self, group: TableGroup) -> int:
        floors = [s.version_floor for s in self._alive(group)]
        return (min(floors) if floors else self._version) + self._scheduling.eta

    def _issue_sample(self, slot: Slot) -> None:
        if slot.state is SlotState.ROLLOUT:
            self._issue(
                RolloutOrder(
                    slot.sample_id,
                    slot.attempt,
                    slot.prompt_id,
                    slot.group_id,
                    slot.index_in_group,
                    slot.issued_version,
                    slot.token,
                )
            )
        else:
            self._issue(
                RewardOrder(
                    slot.sample_id, slot.attempt, slot.prompt_id, slot.group_id, slot.blob_keys["rollout"], slot.token
                )
            )

    def _issue_group(self, group: TableGroup) -> None:
        alive = sorted(self._alive(group), key=lambda s: s.index_in_group)
        self._issue(
            GroupOrder(
                group.group_id,
                max(s.attempt for s in alive),
                group.prompt_id,
                tuple(s.sample_id for s in alive),
                tuple(s.blob_keys["reward"] for s in alive),
                alive[0].token,  # a group's order carries its first surviving member's token
            )
        )

    def _issue_batch(self, batch: TrainBatch) -> None:
        groups = [self._groups[g] for g in batch.group_ids]
        members = [s for g in groups for s in sorted(self._members(g), key=lambda s: s.index_in_group)]
        self._issue(
            TrainOrder(
                batch.batch_id,
                max(s.attempt for s in members),
                batch.group_ids,
                tuple(self._members(g)[0].blob_keys["group"] for g in groups),
                tuple(s.sample_id for s in members),
                batch.trainer_version,
                min(self._deadline(g) for g in groups),
                members[0].token,  # a batch's order carries its first member's token
            )
        )

    async def _bump(self, slots: list[Slot], *, count: bool, **changes: object) -> list[Slot]:
        attempt = max(s.attempt for s in slots) + 1
        bumped = [s.retried(self._now, count_retry=count, attempt=attempt, **changes) for s in slots]
        await self._write_all(bumped)
        return bumped


async def load_slots(store: SlotStore, num_slots: int) -> tuple[list[Slot], list[int]]:
    slots: list[Slot] = []
    revisions: list[int] = []
    for i in range(num_slots):
        entry = await store.get(slot_key(i))
        if entry is None:
            slot = Slot(index=i)
            revisions.append(await store.create(slot_key(i), slot.encode()))
        else:
            slot = Slot.decode(entry.value)
            if slot.index != i:
                raise ValueError(f"store key {slot_key(i)!r} holds slot index {slot.index}")
            revisions.append(entry.revision)
        slots.append(slot)
    for key in await store.keys():
        if key.startswith(SLOT_PREFIX) and int(key[len(SLOT_PREFIX) :]) >= num_slots:
            entry = await store.get(key)
            if entry is not None and Slot.decode(entry.value).is_live:
                raise ValueError(
                    f"store holds live slot {key!r} beyond num_slots={num_slots}; resume with the run's "
                    "original num_slots (the table cannot shrink while slots are live)"
                )
    return slots, revisions
