"""The lifecycle core: the reconciler's slot table, transport-independent.

`Lifecycle` owns S slots (`actors.slots.Slot`), the dataset cursor and the trainer version, all
durable in a `SlotStore`, every write a compare-and-set. It takes events and returns the work to
issue; it never talks to NATS and never reads a clock.

How an actor drives it
----------------------
::

    resumed = await Lifecycle.resume(store, source, config, now=clock(), num_rollout_actors=n)
    core = resumed.lifecycle
    publish(resumed.orders)                                     # re-issued in-flight work
    on done.<stage> message:  publish(await core.on_completion(event, now)); ack
    on heartbeat (in_progress) from an actor:  core.on_heartbeat(stage, key, attempt, actor_id, now)
    on actor registry change:  publish(await core.on_actor_lost(actor_id, now))
                               publish(await core.set_rollout_actors(num_live, now))
    on weights.<run>:          publish(await core.on_trainer_version(version, now))
    on config change:          publish(await core.update_scheduling(new_config, now))
    every second or so:        publish(await core.tick(now))    # timeouts, staleness, admission
    ops status:                core.snapshot(now)

Publish each order on ``work.<order.STAGE>`` with ``order.msg_id`` as the JetStream message id.
Call the core from one task at a time (it also holds a lock). Acknowledge a ``done`` message only
after `on_completion` returned: the durable state then already reflects it, and a redelivery is
ignored idempotently. If any call raises (a `CasConflict` means another reconciler owns the
table; a store error means the table may be behind memory), the core refuses further calls with
`CoreBroken`: drop it and `resume` a new one from the store.

Durability rules: state is written before the work it implies is returned (so published work is
always in the table); an admitted group's slots are written before the cursor moves past its
prompt (a resume rolls back slots at or past the cursor); a dropped group's outcome record is
written before its slots are freed; the trainer version is written before a trained batch's slots
are freed. See `actors.scheduling` for admission and batch selection.
"""

from __future__ import annotations

import dataclasses
import heapq

import structlog

from actors._slot_table import CoreBroken, SlotTable, TableGroup, TrainBatch, load_slots
from actors.lifecycle_events import (
    Completion,
    GroupDone,
    GroupOutcome,
    MetaRecord,
    RewardDone,
    RolloutDone,
    StageFailed,
    TrainDone,
    WorkOrder,
)
from actors.lifecycle_metrics import LifecycleSnapshot
from actors.scheduling import BatchWait, FailedGroupPolicy, GroupView, SchedulingConfig, admission, select_batch
from actors.slot_store import META_KEY, SlotStore, outcome_key
from actors.slots import Slot, SlotState, Stage
from actors.task_cursor import TaskCursor, TaskSource

__all__ = ["CoreBroken", "Lifecycle", "LifecycleConfig", "Resumption"]

log = structlog.get_logger(__name__)


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


class Lifecycle(SlotTable):
    """The slot table and its scheduling. Build with `Lifecycle.resume` (fresh runs too)."""

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

        Rolls back half-written admissions, completes half-done drops and moves, re-issues every
        in-flight stage with a new attempt (not counted as a retry), and discards groups whose
        tokens are already too stale to train (counted and logged).

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
        core = cls(config, store, cursor, slots, revisions, meta, meta_rev)
        core._num_rollout_actors = num_rollout_actors
        counts = await core._guarded(now, core._recover)
        orders = tuple(core._out)
        core._out.clear()
        log.info("lifecycle_resumed", trainer_version=core._version, cursor=cursor.record, **counts)
        return Resumption(core, orders, **counts)

    # ------------------------------------------------------------------ public events
    async def on_completion(self, event: Completion, now: float) -> list[WorkOrder]:
        """Apply a ``done.<stage>`` message; duplicates and stale attempts are ignored (and counted)."""
        match event:
            case RolloutDone():
                return await self._run(now, lambda: self._on_rollout_done(event))
            case RewardDone():
                return await self._run(now, lambda: self._on_reward_done(event))
            case GroupDone():
                return await self._run(now, lambda: self._on_group_done(event))
            case TrainDone():
                return await self._run(now, lambda: self._on_train_done(event))
            case StageFailed():
                return await self._run(now, lambda: self._on_failed(event))
        raise TypeError(f"on_completion takes a Completion, got {type(event).__name__}")

    def on_heartbeat(self, stage: Stage, key: str, attempt: int, actor_id: str, now: float) -> None:
        """An actor is still working on (stage, key, attempt): push its timeout back."""
        issued = self._work.get((Stage(stage), key))
        if issued is not None and issued.attempt == attempt:
            issued.last_seen = max(issued.last_seen, now)
            issued.actor_id = actor_id

    async def on_actor_lost(self, actor_id: str, now: float) -> list[WorkOrder]:
        """Retry (counted) everything the actor was last seen working on."""

        async def lost() -> None:
            held = [unit for unit, issued in self._work.items() if issued.actor_id == actor_id]
            for stage, key in held:
                if (stage, key) in self._work:
                    reason = f"actor {actor_id} lost"
                    await self._retry(stage, key, reason=reason, count=stage is not Stage.TRAIN)
            await self._pump()

        return await self._run(now, lost)

    async def on_trainer_version(self, version: int, now: float) -> list[WorkOrder]:
        """The trainer published weights `version` (never moves the version back)."""
        return await self._run(now, lambda: self._set_version(version))

    async def set_rollout_actors(self, num_actors: int, now: float) -> list[WorkOrder]:
        """The number of live rollout actors (sets the in-flight rollout cap)."""
        if num_actors < 0:
            raise ValueError(f"num_actors must be >= 0, got {num_actors}")

        async def apply() -> None:
            self._num_rollout_actors = num_actors
            await self._pump()

        return await self._run(now, apply)

    async def update_scheduling(self, scheduling: SchedulingConfig, now: float) -> list[WorkOrder]:
        """Change the live policy. Lowering eta drops groups already too stale (counted, logged)."""
        scheduling.check_against(batch_size_groups=self._config.batch_size_groups, group_size=self._config.group_size)

        async def apply() -> None:
            log.info("scheduling_updated", old=dataclasses.asdict(self._scheduling), new=dataclasses.asdict(scheduling))
            self._scheduling = scheduling
            await self._drop_stale()
            await self._pump()

        return await self._run(now, apply)

    async def tick(self, now: float) -> list[WorkOrder]:
        """Retry timed-out work, drop groups past their deadline, hand out batches, admit groups."""

        async def body() -> None:
            await self._drop_stale()
            timed_out = [
                (unit, now - issued.last_seen)
                for unit, issued in self._work.items()
                if now - issued.last_seen > self._timeout(unit[0])
            ]
            for (stage, key), idle in timed_out:
                if (stage, key) in self._work:
                    reason = f"{stage} timed out after {idle:.1f}s"
                    await self._retry(stage, key, reason=reason, count=stage is not Stage.TRAIN)
            await self._pump()

        return await self._run(now, body)

    # ------------------------------------------------------------------ inspection
    @property
    def trainer_version(self) -> int:
        return self._version

    @property
    def scheduling(self) -> SchedulingConfig:
        return self._scheduling

    @property
    def cursor(self) -> TaskCursor:
        return self._cursor

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots)

    @property
    def is_finished(self) -> bool:
        """The dataset is exhausted and every admitted group was trained or dropped."""
        return self._cursor.is_exhausted and not self._groups

    def snapshot(self, now: float) -> LifecycleSnapshot:
        return self.metrics.snapshot(
            now=now,
            trainer_version=self._version,
            cursor=(self._cursor.record.epoch, self._cursor.record.position),
            slots_per_state={state.value: self._counts[state] for state in SlotState},
        )

    # ------------------------------------------------------------------ completions
    def _current_sample(self, stage: Stage, sample_id: str, attempt: int) -> Slot | None:
        index = self._by_sample.get(sample_id)
        slot = self._slots[index] if index is not None else None
        if slot is None or slot.state is not stage.state or slot.attempt != attempt:
            self.metrics.counters["ignored_completions"] += 1
            return None
        return slot

    async def _on_rollout_done(self, event: RolloutDone) -> None:
        slot = self._current_sample(Stage.ROLLOUT, event.sample_id, event.attempt)
        if slot is None:
            return
        self._finish(Stage.ROLLOUT, slot.sample_id, slot.entered_at[SlotState.ROLLOUT])
        if event.min_version < slot.issued_version:
            log.warning(
                "rollout_below_version_floor",
                sample_id=slot.sample_id,
                min_version=event.min_version,
                policy_version_floor=slot.issued_version,
            )
        if event.min_version + self._scheduling.eta < self._version:
            reason = f"tokens of version {event.min_version} exceed eta {self._scheduling.eta} at {self._version}"
            await self._retry(Stage.ROLLOUT, slot.sample_id, reason=reason, count=True)
            return
        new = slot.moved_to(
            SlotState.REWARD,
            self._now,
            min_version=event.min_version,
            max_version=event.max_version,
            blob_keys={**slot.blob_keys, "rollout": event.result_key},
        )
        await self._write(new)
        self._issue_sample(new)

    async def _on_reward_done(self, event: RewardDone) -> None:
        slot = self._current_sample(Stage.REWARD, event.sample_id, event.attempt)
        if slot is None:
            return
        self._finish(Stage.REWARD, slot.sample_id, slot.entered_at[SlotState.REWARD])
        new = slot.moved_to(SlotState.GROUP, self._now, blob_keys={**slot.blob_keys, "reward": event.result_key})
        await self._write(new)
        await self._advance_group(self._groups[new.group_id])

    async def _on_group_done(self, event: GroupDone) -> None:
        group = self._groups.get(event.group_id)
        alive = self._alive(group) if group is not None else []
        if (
            group is None
            or any(s.state is not SlotState.GROUP for s in self._members(group))
            or max(s.attempt for s in alive) != event.attempt
        ):
            self.metrics.counters["ignored_completions"] += 1
            return
        self._finish(Stage.GROUP, group.group_id, max(s.entered_at[SlotState.GROUP] for s in alive))
        keys = {"group": event.result_key}
        await self._write_all(s.moved_to(SlotState.READY, self._now, blob_keys={**s.blob_keys, **keys}) for s in alive)
        self._ready.add(group.group_id)
        await self._pump()

    async def _on_train_done(self, event: TrainDone) -> None:
        batch = self._batch
        if batch is None or batch.batch_id != event.batch_id:
            self.metrics.counters["ignored_completions"] += 1
            return
        groups = [self._groups[g] for g in batch.group_ids]
        members = [s for g in groups for s in self._members(g)]
        self._finish(Stage.TRAIN, batch.batch_id, max(s.entered_at[SlotState.TRAIN] for s in members))
        await self._save_meta(max(self._version, event.trainer_version), None)
        await self._write_all(s.moved_to(SlotState.EMPTY, self._now) for s in members)
        for group in groups:
            del self._groups[group.group_id]
        for s in members:
            self.metrics.record_lag(batch.trainer_version - s.version_floor)
        self.metrics.record_trained(self._now, len(members), len(groups))
        self._batch = None
        log.info("batch_trained", batch_id=batch.batch_id, num_groups=len(groups), policy_version=self._version)
        await self._drop_stale()
        await self._pump()

    async def _on_failed(self, event: StageFailed) -> None:
        stage = Stage(event.stage)
        issued = self._work.get((stage, event.key))
        if issued is None or issued.attempt != event.attempt:
            self.metrics.counters["ignored_completions"] += 1
            return
        await self._retry(stage, event.key, reason=event.reason, count=True)
        await self._pump()

    # ------------------------------------------------------------------ retries, failures, drops
    async def _retry(self, stage: Stage, key: str, *, reason: str, count: bool) -> None:
        self._work.pop((stage, key), None)
        self.metrics.counters["retries"] += 1
        max_retries = self._scheduling.max_retries
        if stage in (Stage.ROLLOUT, Stage.REWARD):
            slot = self._slots[self._by_sample[key]]
            if count and slot.num_retries >= max_retries:
                await self._fail_sample(slot, f"{reason} (after {slot.num_retries} retries)")
                return
            fresh = {"issued_version": self._version} if stage is Stage.ROLLOUT else {}
            (new,) = await self._bump([slot], count=count, **fresh)
            log.info("work_retried", stage=stage.value, sample_id=key, attempt=new.attempt, reason=reason)
            self._issue_sample(new)
            return
        if stage is Stage.GROUP:
            group = self._groups[key]
            alive = self._alive(group)
            if count and max(s.num_retries for s in alive) >= max_retries:
                await self._drop_group(group, f"group stage: {reason}")
                return
            await self._bump(alive, count=count)
            self._issue_group(group)
            return
        assert self._batch is not None and self._batch.batch_id == key, (self._batch, key)
        # A batch is never retried for a counted failure nor dropped on a timeout: the trainer may
        # have trained it, and it answers every attempt of a batch id it decided with that decision.
        members = [s for g in self._batch.group_ids for s in self._members(self._groups[g])]
        if count:  # the trainer rejected this batch id for good (see TrainOrder)
            batch = self._batch
            for group_id in batch.group_ids:
                await self._drop_group(self._groups[group_id], f"train stage: {reason}")
            self._batch = None
            await self._save_meta(self._version, None)
            return
        await self._bump(members, count=count)
        self._issue_batch(self._batch)

    async def _fail_sample(self, slot: Slot, reason: str) -> None:
        await self._write(slot.moved_to(SlotState.FAILED, self._now, failure_reason=reason))
        self.metrics.counters["failed_samples"] += 1
        log.warning("sample_failed", sample_id=slot.sample_id, stage=slot.state.value, reason=reason)
        await self._advance_group(self._groups[slot.group_id])

    async def _advance_group(self, group: TableGroup) -> None:
        """Issue the group stage once every surviving sample is rewarded; apply the failed-group policy."""
        members = self._members(group)
        failed = [s for s in members if s.state is SlotState.FAILED]
        alive = [s for s in members if s.state is not SlotState.FAILED]
        policy = self._scheduling.failed_group_policy
        if failed and (policy is FailedGroupPolicy.DROP_GROUP or len(alive) < self._scheduling.min_group_survivors):
            await self._drop_group(group, f"{len(failed)} sample(s) failed: {failed[0].failure_reason}")
            return
        if any(s.state is not SlotState.GROUP for s in alive) or (Stage.GROUP, group.group_id) in self._work:
            return
        if failed:
            outcome = self._outcome(group, failed, dropped=False, reason="trained without failed samples")
            await self._put_outcome(outcome)
            await self._write_all(s.moved_to(SlotState.EMPTY, self._now) for s in failed)
            group.members = [s.index for s in alive]
            log.warning("group_trains_rest", group_id=group.group_id, num_failed=len(failed))
        self._issue_group(group)

    def _outcome(self, group: TableGroup, failed: list[Slot], *, dropped: bool, reason: str) -> GroupOutcome:
        return GroupOutcome(
            group.group_id,
            group.prompt_id,
            group.epoch,
            group.position,
            dropped,
            reason,
            {s.sample_id: s.failure_reason for s in failed},
        )

    async def _drop_group(self, group: TableGroup, reason: str) -> None:
        members = self._members(group)
        failed = [s for s in members if s.state is SlotState.FAILED]
        await self._put_outcome(self._outcome(group, failed, dropped=True, reason=reason))
        for s in members:
            self._work.pop((Stage.ROLLOUT, s.sample_id), None)
            self._work.pop((Stage.REWARD, s.sample_id), None)
        self._work.pop((Stage.GROUP, group.group_id), None)
        await self._write_all(s.moved_to(SlotState.EMPTY, self._now) for s in members)
        del self._groups[group.group_id]
        self._ready.discard(group.group_id)
        self.metrics.counters["dropped_groups"] += 1
        log.warning("group_dropped", group_id=group.group_id, prompt_id=group.prompt_id, reason=reason)

    async def _drop_stale(self) -> int:
        training = set(self._batch.group_ids) if self._batch is not None else set()
        stale = [g for gid, g in self._groups.items() if gid not in training and self._deadline(g) < self._version]
        for group in stale:
            oldest = self._deadline(group) - self._scheduling.eta
            reason = f"stale: oldest token version {oldest} + eta {self._scheduling.eta} < trainer {self._version}"
            self.metrics.counters["stale_dropped_groups"] += 1
            await self._drop_group(group, reason)
        return len(stale)

    # ------------------------------------------------------------------ batches and admission
    async def _pump(self) -> None:
        await self._hand_out_batch()
        await self._admit()

    async def _hand_out_batch(self) -> None:
        final = self._cursor.is_exhausted
        if self._batch is not None or (len(self._ready) < self._config.batch_size_groups and not final):
            return
        views = [GroupView(self._deadline(g), gid, gid in self._ready) for gid, g in self._groups.items()]
        decision = select_batch(
            views, trainer_version=self._version, batch_size_groups=self._config.batch_size_groups, final=final
        )
        if not decision.group_ids:
            if decision.wait is not BatchWait.NOT_ENOUGH_READY:
                self.metrics.record_batch_wait(decision.wait.value)
            return
        batch = TrainBatch(f"b{self._version}-{decision.group_ids[0]}", decision.group_ids, self._version)
        members = [s for g in batch.group_ids for s in self._members(self._groups[g])]
        assert all(self._version - s.version_floor <= self._scheduling.eta for s in members), batch
        await self._save_meta(self._version, batch)
        await self._write_all(s.moved_to(SlotState.TRAIN, self._now, batch_id=batch.batch_id) for s in members)
        self._ready.difference_update(batch.group_ids)
        self._batch = batch
        self._issue_batch(batch)

    async def _admit(self) -> None:
        decision = admission(
            self._scheduling,
            batch_size_groups=self._config.batch_size_groups,
            group_size=self._config.group_size,
            num_live_groups=len(self._groups),
            num_ready_groups=len(self._ready),
            num_inflight_rollouts=self._counts[SlotState.ROLLOUT],
            num_rollout_actors=self._num_rollout_actors,
            num_free_slots=len(self._free),
        )
        prompts = self._cursor.peek(decision.num_groups) if decision.num_groups else []
        if not prompts:
            self.metrics.record_admission(0, "exhausted" if decision.num_groups else decision.limit.value)
            return
        size = self._config.group_size
        new = [
            Slot.admitted(
                heapq.heappop(self._free),
                prompt_id=p.prompt_id,
                epoch=p.epoch,
                position=p.position,
                index_in_group=j,
                trainer_version=self._version,
                now=self._now,
            )
            for p in prompts
            for j in range(size)
        ]
        await self._write_all(new)
        await self._cursor.advance_to(self._cursor.after(prompts[-1]))
        for k, p in enumerate(prompts):
            slots = new[k * size : (k + 1) * size]
            self._groups[slots[0].group_id] = TableGroup(
                slots[0].group_id, p.prompt_id, p.epoch, p.position, [s.index for s in slots]
            )
            for s in slots:
                self._issue_sample(s)
        self.metrics.record_admission(len(prompts), decision.limit.value)

    # ------------------------------------------------------------------ resume
    async def _recover(self) -> dict[str, int]:
        cursor = self._cursor
        half_admitted = [s for s in self._slots if s.is_live and not cursor.admitted(s.epoch, s.position)]
        await self._write_all(s.moved_to(SlotState.EMPTY, self._now) for s in half_admitted)
        for s in self._slots:
            if s.is_live:
                group = self._groups.get(s.group_id)
                if group is None:
                    group = self._groups[s.group_id] = TableGroup(s.group_id, s.prompt_id, s.epoch, s.position, [])
                group.members.append(s.index)
        num_dropped = await self._finish_interrupted()
        await self._restore_batch()
        training = self._batch.group_ids if self._batch is not None else ()
        num_reissued = 0
        for group in list(self._groups.values()):
            if group.group_id not in training:
                num_reissued += await self._reissue(group)
        if self._batch is not None:
            members = [s for g in self._batch.group_ids for s in self._members(self._groups[g])]
            await self._bump(members, count=False)
            self._issue_batch(self._batch)
            num_reissued += 1
        await self._pump()
        return {
            "num_rolled_back_slots": len(half_admitted),
            "num_discarded_groups": num_dropped,
            "num_reissued": num_reissued,
        }

    async def _finish_interrupted(self) -> int:
        """Complete drops, frees and moves a crash cut short; discard groups now too stale to train."""
        num_dropped = 0
        for group in list(self._groups.values()):
            entry = await self._store.get(outcome_key(group.group_id))
            if entry is not None and GroupOutcome.decode(entry.value).dropped:
                await self._drop_group(group, GroupOutcome.decode(entry.value).reason + " (completed on resume)")
                continue
            members = self._members(group)
            states = {s.state for s in members}
            if SlotState.TRAIN in states and group.group_id not in self._meta.batch_group_ids:
                # the batch was trained (meta is cleared before a trained batch's slots are freed)
                await self._write_all(s.moved_to(SlotState.EMPTY, self._now) for s in members)
                del self._groups[group.group_id]
                continue
            if SlotState.READY in states and SlotState.GROUP in states:
                keys = {"group": next(s.blob_keys["group"] for s in members if s.state is SlotState.READY)}
                await self._write_all(
                    s.moved_to(SlotState.READY, self._now, blob_keys={**s.blob_keys, **keys})
                    for s in members
                    if s.state is SlotState.GROUP
                )
            alive = self._alive(group)
            refreshed = [self._version if s.state is SlotState.ROLLOUT else s.version_floor for s in alive]
            in_batch = group.group_id in self._meta.batch_group_ids
            if not in_batch and alive and min(refreshed) + self._scheduling.eta < self._version:
                num_dropped += 1
                self.metrics.counters["discarded_on_resume"] += 1
                await self._drop_group(group, f"stale on resume: oldest token version {min(refreshed)}")
        return num_dropped

    async def _restore_batch(self) -> None:
        """Rebuild the batch in training from the meta record, finishing its READY → TRAIN moves."""
        meta = self._meta
        if not meta.batch_id:
            return
        group_ids = tuple(g for g in meta.batch_group_ids if g in self._groups)
        if not group_ids:
            await self._save_meta(self._version, None)
            return
        for group_id in group_ids:
            members = self._members(self._groups[group_id])
            await self._write_all(
                s.moved_to(SlotState.TRAIN, self._now, batch_id=meta.batch_id)
                for s in members
                if s.state is SlotState.READY
            )
        self._batch = TrainBatch(meta.batch_id, group_ids, meta.batch_version)

    async def _reissue(self, group: TableGroup) -> int:
        """Re-issue a group's in-flight work with a new attempt (not counted as a retry)."""
        members = self._members(group)
        if all(s.state is SlotState.READY for s in members):
            self._ready.add(group.group_id)
            return 0
        num = 0
        for slot in members:
            if slot.state in (SlotState.ROLLOUT, SlotState.REWARD):
                fresh = {"issued_version": self._version} if slot.state is SlotState.ROLLOUT else {}
                (new,) = await self._bump([slot], count=False, **fresh)
                self._issue_sample(new)
                num += 1
        alive = self._alive(group)
        if alive and all(s.state is SlotState.GROUP for s in alive) and len(alive) == len(members):
            await self._bump(alive, count=False)
            num += 1
        await self._advance_group(group)
        return num
