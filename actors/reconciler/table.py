"""The slot table: the in-memory mirror of the store's slots, the groups they form, and the run's meta record.

Every write goes through `SlotTable.write` (a compare-and-set on the slot's revision, then the
in-memory indexes), so memory never runs ahead of the store. The table decides nothing: the flow
(`actors.reconciler.flow`) and the resume (`actors.reconciler.recovery`) say what to write.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Iterable

import structlog

from actors.reconciler.metrics import LifecycleMetrics
from actors.reconciler.slot import Slot, SlotState
from actors.reconciler.store import (
    META_KEY,
    OUTCOME_PREFIX,
    SLOT_PREFIX,
    SlotStore,
    fenced_by_any_write,
    outcome_key,
    slot_key,
)
from actors.reconciler.work import GroupOutcome, MetaRecord

__all__ = ["SlotTable", "TableGroup", "TrainBatch", "load_slots"]

log = structlog.get_logger(__name__)


@dataclasses.dataclass(slots=True)
class TableGroup:
    """The G slots admitted for one prompt (fewer once failed samples were freed)."""

    group_id: str
    prompt_id: str
    epoch: int
    position: int
    members: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class TrainBatch:
    batch_id: str
    group_ids: tuple[str, ...]
    trainer_version: int


class SlotTable:
    """S slots mirrored from the store, their groups, the batch in training and the trainer version.

    Reads are plain attribute and method calls; every change of a slot, an outcome or the meta record
    is a compare-and-set write through this object. `now` is the caller's clock of the current call.
    """

    def __init__(
        self,
        store: SlotStore,
        slots: list[Slot],
        revisions: list[int],
        meta: MetaRecord,
        meta_revision: int,
        metrics: LifecycleMetrics,
        transition_events_per_s: float,
    ) -> None:
        self._store = store
        self._slots = slots
        self._revs = revisions
        self._meta = meta
        self._meta_rev = meta_revision
        self._metrics = metrics
        self._counts: Counter[SlotState] = Counter(s.state for s in slots)
        self._by_sample = {s.sample_id: s.index for s in slots if s.is_live}
        self._free = [s.index for s in slots if not s.is_live]
        heapq.heapify(self._free)
        self._released: list[int] = []  # freed in memory, their stored record not yet overwritten (see release)
        self._log = _TransitionLog(transition_events_per_s)
        self.now = 0.0
        self.version = meta.trainer_version
        self.groups: dict[str, TableGroup] = {}
        self.ready: set[str] = set()  # groups whose members are all READY, not in a batch
        self.batch: TrainBatch | None = None

    # ------------------------------------------------------------------ reads
    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots)

    @property
    def fenced_by_any_write(self) -> bool:
        """One write of this table fences off any other core writing it (`actors.reconciler.store.SlotStore`)."""
        return fenced_by_any_write(self._store)

    @property
    def meta(self) -> MetaRecord:
        return self._meta

    def by_sample(self, sample_id: str) -> Slot | None:
        index = self._by_sample.get(sample_id)
        return self._slots[index] if index is not None else None

    def count(self, state: SlotState) -> int:
        return self._counts[state]

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._released)

    def take_free(self) -> int:
        """A free slot index (it is written by the caller next): a released one first, whose stored record
        the caller's write then replaces (one write instead of two), else the lowest free one."""
        if self._released:
            return self._released.pop()
        return heapq.heappop(self._free)

    def members(self, group: TableGroup) -> list[Slot]:
        return [self._slots[i] for i in group.members]

    def alive(self, group: TableGroup) -> list[Slot]:
        return [s for s in self.members(group) if s.state is not SlotState.FAILED]

    def batch_members(self, batch: TrainBatch) -> list[Slot]:
        return [s for g in batch.group_ids for s in self.members(self.groups[g])]

    # ------------------------------------------------------------------ writes
    async def write(self, new: Slot) -> None:
        i = new.index
        old = self._slots[i]
        self._revs[i] = await self._store.update(slot_key(i), new.encode(), self._revs[i])
        self._metrics.counters["slot_writes"] += 1
        self._set(old, new)

    def _set(self, old: Slot, new: Slot, *, released: bool = False) -> None:
        i = new.index
        self._slots[i] = new
        self._counts[old.state] -= 1
        self._counts[new.state] += 1
        if old.sample_id and old.sample_id != new.sample_id:
            self._by_sample.pop(old.sample_id, None)
        if new.sample_id:
            self._by_sample[new.sample_id] = i
        if old.is_live and not new.is_live and not released:
            heapq.heappush(self._free, i)
        self._metrics.counters["transitions"] += 1
        self._log.transition(old, new, self.now, self.version)

    def release(self, trained: Iterable[Slot]) -> None:
        """Free the slots of a trained batch in memory; their stored records (TRAIN, of a batch the meta
        record no longer names) are overwritten by the next admissions of this core call, and the rest
        written EMPTY at its end (`write_released`). Until then a resume frees them as trained slots."""
        for slot in trained:
            self._set(slot, slot.moved_to(SlotState.EMPTY, self.now), released=True)
            self._released.append(slot.index)
        self._released.sort(reverse=True)  # take_free pops the lowest first

    async def write_released(self) -> None:
        """Write EMPTY over every released slot no admission reused (the end of each core call)."""
        while self._released:
            i = self._released.pop()
            self._revs[i] = await self._store.update(slot_key(i), self._slots[i].encode(), self._revs[i])
            self._metrics.counters["slot_writes"] += 1
            heapq.heappush(self._free, i)

    async def write_all(self, slots: Iterable[Slot]) -> None:
        # One after another: with the reconciler's group-commit store a write only joins a buffer,
        # and a task per write (gather) cost more than the write itself.
        for slot in slots:
            await self.write(slot)

    async def outcomes(self) -> dict[str, GroupOutcome]:
        """Every outcome record by group id, in one bulk read (a resume asks for those of all live groups)."""
        entries = await self._store.items(OUTCOME_PREFIX)
        return {key[len(OUTCOME_PREFIX):]: GroupOutcome.decode(entry.value) for key, entry in entries.items()}

    async def put_outcome(self, outcome: GroupOutcome) -> None:
        """Record (or merge into the earlier record) why a group did not train whole."""
        key = outcome_key(outcome.group_id)
        entry = await self._store.get(key)
        if entry is None:
            await self._store.create(key, outcome.encode())
            return
        earlier = GroupOutcome.decode(entry.value)
        merged = dataclasses.replace(outcome, failed_samples={**earlier.failed_samples, **outcome.failed_samples})
        await self._store.update(key, merged.encode(), entry.revision)

    async def save_meta(self, version: int, batch: TrainBatch | None) -> None:
        """The trainer version and the batch in training, durable (meta record) before anything acts on them."""
        meta = MetaRecord(version)
        if batch is not None:
            meta = MetaRecord(version, batch.batch_id, batch.group_ids, batch.trainer_version)
        self._meta_rev = await self._store.update(META_KEY, meta.encode(), self._meta_rev)
        self._meta = meta
        self.version = version


class _TransitionLog:
    """``slot_transition`` events, at most `rate` per second of the caller's clock (the rest counted)."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._allowance = 0.0
        self._last = 0.0
        self._suppressed = 0

    def transition(self, old: Slot, new: Slot, now: float, version: int) -> None:
        if self._rate == 0:
            return
        self._allowance = min(self._rate, self._allowance + (now - self._last) * self._rate)
        self._last = now
        if self._allowance < 1.0:
            self._suppressed += 1
            return
        self._allowance -= 1.0
        sample = new if new.is_live else old
        log.info(
            "slot_transition",
            slot=new.index,
            sample_id=sample.sample_id,
            from_state=old.state.value,
            to_state=new.state.value,
            attempt=new.attempt,
            policy_version=version,
            num_suppressed=self._suppressed,
        )
        self._suppressed = 0


async def load_slots(store: SlotStore, num_slots: int) -> tuple[list[Slot], list[int]]:
    """The table's slots and their revisions from `store` (EMPTY ones created where missing), read in one
    bulk read of the slot keys: a resume's cost grows with the table's bytes, not with round trips.

    Raises:
        ValueError: the store holds live slots beyond `num_slots`.
    """
    stored = await store.items(SLOT_PREFIX)
    slots: list[Slot] = []
    revisions: list[int] = []
    for i in range(num_slots):
        key = slot_key(i)
        entry = stored.pop(key, None)
        if entry is None:
            slot = Slot(index=i)
            revisions.append(await store.create(key, slot.encode()))
        else:
            slot = Slot.decode(entry.value)
            if slot.index != i:
                raise ValueError(f"store key {key!r} holds slot index {slot.index}")
            revisions.append(entry.revision)
        slots.append(slot)
    for key, entry in stored.items():  # the keys left: beyond num_slots
        if Slot.decode(entry.value).is_live:
            raise ValueError(
                f"store holds live slot {key!r} beyond num_slots={num_slots}; resume with the run's "
                "original num_slots (the table cannot shrink while slots are live)"
            )
    return slots, revisions
