"""The lifecycle core: the reconciler's slot table, transport-independent.

`Lifecycle` owns S slots (`actors.reconciler.slot.Slot`), the dataset cursor and the trainer version, all
durable in a `SlotStore`, every write a compare-and-set. It takes events and returns the work to
issue; it never talks to NATS and never reads a clock.

How an actor drives it
----------------------
::

    resumed = await Lifecycle.resume(store, source, config, now=clock(), num_rollout_actors=n)
    core = resumed.lifecycle
    publish(resumed.orders)                                     # re-issued in-flight work
    on done.<stage> message:  publish(await core.on_completion(event, now)); ack
    on heartbeat (in_progress) from an actor:  core.on_heartbeat(stage, key, attempt, actor_id, now, token)
    on actor registry change:  publish(await core.on_actor_lost(actor_id, now))
                               publish(await core.set_rollout_actors(num_live, now))
    on weights.<run>:          publish(await core.on_trainer_version(version, now))
    on config change:          publish(await core.update_scheduling(new_config, now))
    every second or so:        publish(await core.tick(now))    # timeouts, staleness, admission
    ops status:                core.snapshot(now)

Publish each order on ``work.<order.STAGE>`` with ``order.msg_id`` as the JetStream message id; a
completion (or heartbeat) counts only with the order's issuance token (`actors.reconciler.work`).
Call the core from one task at a time (it also holds a lock). Acknowledge a ``done`` message only
after `on_completion` returned: the durable state then already reflects it, and a redelivery is
ignored idempotently. If any call raises (a `CasConflict` means another reconciler owns the
table; a store error means the table may be behind memory), the core refuses further calls with
`CoreBroken`: drop it and `resume` a new one from the store.

Durability rules: state is written before the work it implies is returned (so published work is
always in the table); an admitted group's slots are written before the cursor moves past its
prompt (a resume rolls back slots at or past the cursor); a dropped group's outcome record is
written before its slots are freed; the trainer version is written before a trained batch's slots
are freed (each by the admission that reuses it in the same call, the rest written EMPTY at the
call's end: a resume frees TRAIN slots of a batch the meta record no longer names). See
`actors.reconciler.scheduling` for admission and batch selection.

Parts, one concept each, composed (not inherited): `actors.reconciler.table.SlotTable` (the
in-memory mirror of the store and its write discipline), `actors.reconciler.issuance.Issuance` (the
work in flight and its tokens), `actors.reconciler.flow.LifecycleFlow` (completions, retries, drops,
batches, admission), `actors.reconciler.recovery` (resume), and this module's `Lifecycle` (construction,
the call discipline and the public events).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import structlog

from actors.reconciler.flow import LifecycleFlow
from actors.reconciler.issuance import Issuance
from actors.reconciler.metrics import LifecycleMetrics, LifecycleSnapshot
from actors.reconciler.recovery import recover, reissue_unconfirmed
from actors.reconciler.scheduling import SchedulingConfig
from actors.reconciler.slot import SampleLifecycleError, Slot, SlotState, Stage
from actors.reconciler.store import META_KEY, SlotStore
from actors.reconciler.table import SlotTable, load_slots
from actors.reconciler.task_cursor import TaskCursor, TaskSource
from actors.reconciler.work import (
    Completion,
    MetaRecord,
    WorkOrder,
)

__all__ = ["CoreBroken", "Lifecycle", "LifecycleConfig", "Resumption"]

log = structlog.get_logger(__name__)
T = TypeVar("T")


class CoreBroken(SampleLifecycleError, RuntimeError):
    """An earlier call failed part-way; this core may disagree with the store. Resume a new one."""


@dataclasses.dataclass(frozen=True)
class LifecycleConfig:
    """Shape of the table (fixed for a run) and the live scheduling policy it starts with.

    Attributes:
        num_slots: S, samples held at once; at least one batch (group_size × batch_size_groups).
        group_size: G, samples per prompt.
        batch_size_groups: B, groups per training step.
        num_epochs: passes over the task source; 1 is single-epoch, None unbounded.
        scheduling: initial `SchedulingConfig`.
        transition_events_per_s: at most this many ``slot_transition`` events per second of the
            caller's clock; the rest are counted in the next event's ``num_suppressed``. 0 disables.
        metrics_window_s: window of the throughput figures.
    """

    num_slots: int
    group_size: int
    batch_size_groups: int
    num_epochs: int | None = 1
    scheduling: SchedulingConfig = dataclasses.field(default_factory=SchedulingConfig)
    transition_events_per_s: float = 20.0
    metrics_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.batch_size_groups < 1:
            raise ValueError(
                f"group_size ({self.group_size}) and batch_size_groups ({self.batch_size_groups}) must be >= 1"
            )
        if self.num_slots < self.group_size * self.batch_size_groups:
            raise ValueError(
                f"num_slots={self.num_slots} cannot hold one batch of {self.batch_size_groups} groups × "
                f"{self.group_size} samples; use num_slots >= {self.group_size * self.batch_size_groups}"
            )
        if self.transition_events_per_s < 0 or self.metrics_window_s <= 0:
            raise ValueError("transition_events_per_s must be >= 0 and metrics_window_s > 0")
        self.scheduling.check_against(batch_size_groups=self.batch_size_groups, group_size=self.group_size)


@dataclasses.dataclass(frozen=True)
class Resumption:
    """What `Lifecycle.resume` rebuilt: the core, the work to (re-)issue now, and what it undid."""

    lifecycle: Lifecycle
    orders: tuple[WorkOrder, ...]
    num_rolled_back_slots: int
    num_discarded_groups: int
    num_reissued: int
    num_adopted: int = 0


class Lifecycle:
    """The slot table and its scheduling. Build with `Lifecycle.resume` (fresh runs too)."""

    def __init__(
        self, config: LifecycleConfig, table: SlotTable, cursor: TaskCursor, metrics: LifecycleMetrics
    ) -> None:
        self._config = config
        self._table = table
        self._cursor = cursor
        self.metrics = metrics
        self._issuance = Issuance(metrics)
        self._flow = LifecycleFlow(config, table, self._issuance, cursor, metrics)
        self._lock = asyncio.Lock()
        self._broken = False

    # ------------------------------------------------------------------ construction and resume
    @classmethod
    async def resume(
        cls,
        store: SlotStore,
        source: TaskSource,
        config: LifecycleConfig,
        now: float,
        *,
        num_rollout_actors: int = 0,
    ) -> Resumption:
        """Load (or create) the table from `store` and bring it back to a consistent, running state.

        Rolls back half-written admissions, completes half-done drops and moves, adopts the rollout and
        reward attempts in flight (their actors may be alive; `tick` re-issues those nobody owns up to
        within ``scheduling.adopt_grace_s``), re-issues the other in-flight stages with a new attempt
        (not counted as a retry), and discards groups whose tokens are already too stale to train
        (counted and logged).

        Raises:
            ValueError: the store holds live slots beyond ``config.num_slots``.
            SlotDecodeError: a stored record has another schema version.
        """
        cursor = await TaskCursor.load(store, source, config.num_epochs)
        entry = await store.get(META_KEY)
        if entry is None:
            meta, meta_rev = MetaRecord(), await store.create(META_KEY, MetaRecord().encode())
        else:
            meta, meta_rev = MetaRecord.decode(entry.value), entry.revision
        slots, revisions = await load_slots(store, config.num_slots)
        metrics = LifecycleMetrics(window_s=config.metrics_window_s)
        table = SlotTable(store, slots, revisions, meta, meta_rev, metrics, config.transition_events_per_s)
        core = cls(config, table, cursor, metrics)
        core._flow.num_rollout_actors = num_rollout_actors
        counts = await core._guarded(now, lambda: recover(core._flow))
        orders = tuple(core._issuance.take_orders())
        log.info("lifecycle_resumed", trainer_version=table.version, cursor=cursor.record, **counts)
        return Resumption(core, orders, **counts)

    # ------------------------------------------------------------------ call discipline
    async def _run(self, now: float, body: Callable[[], Awaitable[None]]) -> list[WorkOrder]:
        await self._guarded(now, body)
        return self._issuance.take_orders()

    async def _guarded(self, now: float, body: Callable[[], Awaitable[T]]) -> T:
        if self._broken:
            raise CoreBroken("an earlier call on this lifecycle core failed; resume a new core from the store")
        async with self._lock:
            self._table.now = max(self._table.now, now)
            try:
                result = await body()
                await self._table.write_released()
                return result
            except BaseException:
                self._broken = True
                raise

    # ------------------------------------------------------------------ public events
    async def on_completion(self, event: Completion, now: float) -> list[WorkOrder]:
        """Apply a ``done.<stage>`` message; duplicates and stale attempts are ignored (and counted)."""
        if not isinstance(event, Completion):
            raise TypeError(f"on_completion takes a Completion, got {type(event).__name__}")
        return await self._run(now, lambda: self._flow.apply(event))

    async def on_completions(self, events: Iterable[Completion], now: float) -> list[WorkOrder]:
        """Apply several completions in one call (a group order's answers), each judged on its own."""
        events = tuple(events)
        for event in events:
            if not isinstance(event, Completion):
                raise TypeError(f"on_completions takes Completions, got {type(event).__name__}")

        async def body() -> None:
            for event in events:
                await self._flow.apply(event)

        return await self._run(now, body)

    def on_heartbeat(self, stage: Stage, key: str, attempt: int, actor_id: str, now: float, token: str = "") -> None:
        """An actor is still working on (stage, key, attempt) issued with `token`: push its timeout back.
        A heartbeat without the order's token keeps nothing alive (counted, logged)."""
        self._issuance.heartbeat(Stage(stage), key, attempt, actor_id, token, now)

    def is_current(self, stage: Stage, key: str, attempt: int) -> bool:
        """Is (stage, key, attempt) the work the table waits for? Not an attempt superseded by a retry
        (after a loss, a timeout or a resume), nor work already completed."""
        return self._issuance.is_current(Stage(stage), key, attempt)

    async def on_actor_lost(self, actor_id: str, now: float) -> list[WorkOrder]:
        """Retry (counted) everything the actor was last seen working on."""

        async def lost() -> None:
            for stage, key in self._issuance.held_by(actor_id):
                if self._issuance.is_pending(stage, key):
                    reason = f"actor {actor_id} lost"
                    await self._flow.retry(stage, key, reason=reason, count=stage is not Stage.TRAIN)
            await self._flow.pump()

        return await self._run(now, lost)

    async def on_trainer_version(self, version: int, now: float) -> list[WorkOrder]:
        """The trainer published weights `version` (never moves the version back)."""
        return await self._run(now, lambda: self._flow.set_version(version))

    async def set_rollout_actors(self, num_actors: int, now: float) -> list[WorkOrder]:
        """The number of live rollout actors (sets the in-flight rollout cap)."""
        if num_actors < 0:
            raise ValueError(f"num_actors must be >= 0, got {num_actors}")

        async def apply() -> None:
            self._flow.num_rollout_actors = num_actors
            await self._flow.pump()

        return await self._run(now, apply)

    async def update_scheduling(self, scheduling: SchedulingConfig, now: float) -> list[WorkOrder]:
        """Change the live policy. Lowering eta drops groups already too stale (counted, logged)."""
        scheduling.check_against(batch_size_groups=self._config.batch_size_groups, group_size=self._config.group_size)

        async def apply() -> None:
            old = self._flow.scheduling
            log.info("scheduling_updated", old=dataclasses.asdict(old), new=dataclasses.asdict(scheduling))
            self._flow.scheduling = scheduling
            await self._flow.drop_stale()
            await self._flow.pump()

        return await self._run(now, apply)

    async def tick(self, now: float) -> list[WorkOrder]:
        """Retry timed-out work, re-issue adopted work nobody owned up to, drop groups past their deadline,
        hand out batches, admit groups."""
        flow = self._flow

        async def body() -> None:
            await flow.drop_stale(if_changed=True)
            await reissue_unconfirmed(flow, now)
            for stage, key, idle in list(self._issuance.timed_out(now, flow.timeout_s)):
                if self._issuance.is_pending(stage, key):
                    reason = f"{stage} timed out after {idle:.1f}s"
                    await flow.retry(stage, key, reason=reason, count=stage is not Stage.TRAIN)
            await flow.pump()

        return await self._run(now, body)

    # ------------------------------------------------------------------ inspection
    def is_live_group(self, group_id: str) -> bool:
        """Whether the group is in the table (admitted, neither trained nor dropped): a lookup, no walk."""
        return group_id in self._table.groups

    def take_left_groups(self) -> list[str]:
        """The groups that left the table (trained or dropped) since the last call: what the caller retires,
        read without walking the table."""
        left, self._flow.left = self._flow.left, []
        return left

    @property
    def trainer_version(self) -> int:
        return self._table.version

    @property
    def scheduling(self) -> SchedulingConfig:
        return self._flow.scheduling

    @property
    def cursor(self) -> TaskCursor:
        return self._cursor

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self._table.slots

    @property
    def is_finished(self) -> bool:
        """The dataset is exhausted and every admitted group was trained or dropped."""
        return self._cursor.is_exhausted and not self._table.groups

    def snapshot(self, now: float) -> LifecycleSnapshot:
        return self.metrics.snapshot(
            now=now,
            trainer_version=self._table.version,
            cursor=(self._cursor.record.epoch, self._cursor.record.position),
            slots_per_state={state.value: self._table.count(state) for state in SlotState},
        )
