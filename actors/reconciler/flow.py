"""The forward flow of samples through the slot table: completions, retries, drops, batches, admission.

`LifecycleFlow` decides; the `SlotTable` records and the `Issuance` holds the work in flight. Each
method runs inside one core call (`actors.reconciler.lifecycle.Lifecycle`), writes through the table
before it issues the work a write implies, and leaves the orders in the issuance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from actors.reconciler.issuance import Issuance
from actors.reconciler.metrics import LifecycleMetrics
from actors.reconciler.scheduling import (
    BatchDecision,
    BatchWait,
    FailedGroupPolicy,
    GroupView,
    admission,
    select_batch,
)
from actors.reconciler.slot import Slot, SlotState, Stage
from actors.reconciler.table import SlotTable, TableGroup, TrainBatch
from actors.reconciler.task_cursor import TaskCursor
from actors.reconciler.work import Completion, GroupDone, GroupOutcome, RewardDone, RolloutDone, StageFailed, TrainDone

if TYPE_CHECKING:
    from actors.reconciler.lifecycle import LifecycleConfig

__all__ = ["LifecycleFlow"]

log = structlog.get_logger(__name__)


class LifecycleFlow:
    """Moves samples forward on completions; retries, fails and drops; hands out batches; admits groups."""

    def __init__(
        self, config: LifecycleConfig, table: SlotTable, issuance: Issuance, cursor: TaskCursor,
        metrics: LifecycleMetrics,
    ) -> None:
        self.config = config
        self.scheduling = config.scheduling
        self.num_rollout_actors = 0
        self.table = table
        self.issuance = issuance
        self.cursor = cursor
        self.metrics = metrics
        self.left: list[str] = []  # groups that left the table (trained or dropped) since `Lifecycle.take_left_groups`
        # (trainer version, eta) at the last `drop_stale`: only a change of either makes a group stale (a rollout
        # whose tokens would be is retried, a retry takes the current version), so a tick with neither changed
        # need not read every group of the table
        self._stale_checked: tuple[int, int] | None = None

    # ------------------------------------------------------------------ small helpers
    def timeout_s(self, stage: Stage) -> float:
        return getattr(self.scheduling, f"{stage.value}_timeout_s")

    def deadline(self, group: TableGroup) -> int:
        """The last trainer version the group may train at (its oldest tokens + eta)."""
        floors = [s.version_floor for s in self.table.alive(group)]
        return (min(floors) if floors else self.table.version) + self.scheduling.eta

    def _finish(self, stage: Stage, key: str, started: float) -> None:
        self.issuance.withdraw(stage, key)
        self.metrics.record_latency(stage.value, self.table.now - started)

    def issue_group(self, group: TableGroup) -> None:
        self.issuance.issue_group(group, self.table.alive(group), self.table.now)

    def issue_batch(self, batch: TrainBatch) -> None:
        groups = [self.table.groups[g] for g in batch.group_ids]
        deadline = min(self.deadline(g) for g in groups)
        self.issuance.issue_batch(batch, [self.table.members(g) for g in groups], deadline, self.table.now)

    async def bump(self, slots: list[Slot], *, count: bool, **changes: object) -> list[Slot]:
        """Re-issue the slots' stage with one next attempt for all (a group's members move together)."""
        attempt = max(s.attempt for s in slots) + 1
        bumped = [s.retried(self.table.now, count_retry=count, attempt=attempt, **changes) for s in slots]
        await self.table.write_all(bumped)
        return bumped

    async def set_version(self, version: int) -> None:
        if version > self.table.version:
            await self.table.save_meta(version, self.table.batch)
            await self.drop_stale()
        await self.pump()

    # ------------------------------------------------------------------ completions
    async def apply(self, event: Completion) -> None:
        match event:
            case RolloutDone():
                await self.on_rollout_done(event)
            case RewardDone():
                await self.on_reward_done(event)
            case GroupDone():
                await self.on_group_done(event)
            case TrainDone():
                await self.on_train_done(event)
            case StageFailed():
                await self.on_failed(event)

    def _current_sample(self, stage: Stage, event: RolloutDone | RewardDone) -> Slot | None:
        if not self.issuance.is_issued(stage, event.sample_id, event.attempt, event.token, "completion"):
            return None
        slot = self.table.by_sample(event.sample_id)
        if slot is None or slot.state is not stage.state or slot.attempt != event.attempt:
            self.metrics.counters["ignored_completions"] += 1
            return None
        return slot

    async def on_rollout_done(self, event: RolloutDone) -> None:
        slot = self._current_sample(Stage.ROLLOUT, event)
        if slot is None:
            return
        table, eta = self.table, self.scheduling.eta
        self._finish(Stage.ROLLOUT, slot.sample_id, slot.entered_at[SlotState.ROLLOUT])
        if event.min_version < slot.issued_version:  # a rollout resumed from a checkpoint keeps its older tokens
            log.info(
                "rollout_below_version_floor",
                sample_id=slot.sample_id,
                min_version=event.min_version,
                policy_version_floor=slot.issued_version,
            )
        if event.min_version + eta < table.version:
            reason = f"tokens of version {event.min_version} exceed eta {eta} at {table.version}"
            await self.retry(Stage.ROLLOUT, slot.sample_id, reason=reason, count=True)
            return
        new = slot.moved_to(
            SlotState.REWARD,
            table.now,
            min_version=event.min_version,
            max_version=event.max_version,
            blob_keys={**slot.blob_keys, "rollout": event.result_key},
        )
        await table.write(new)
        self.issuance.issue_sample(new, table.now)

    async def on_reward_done(self, event: RewardDone) -> None:
        slot = self._current_sample(Stage.REWARD, event)
        if slot is None:
            return
        self._finish(Stage.REWARD, slot.sample_id, slot.entered_at[SlotState.REWARD])
        new = slot.moved_to(SlotState.GROUP, self.table.now, blob_keys={**slot.blob_keys, "reward": event.result_key})
        await self.table.write(new)
        await self.advance_group(self.table.groups[new.group_id])

    async def on_group_done(self, event: GroupDone) -> None:
        if not self.issuance.is_issued(Stage.GROUP, event.group_id, event.attempt, event.token, "completion"):
            return
        table = self.table
        group = table.groups.get(event.group_id)
        alive = table.alive(group) if group is not None else []
        if (
            group is None
            or any(s.state is not SlotState.GROUP for s in table.members(group))
            or max(s.attempt for s in alive) != event.attempt
        ):
            self.metrics.counters["ignored_completions"] += 1
            return
        self._finish(Stage.GROUP, group.group_id, max(s.entered_at[SlotState.GROUP] for s in alive))
        keys = {"group": event.result_key}
        await table.write_all(s.moved_to(SlotState.READY, table.now, blob_keys={**s.blob_keys, **keys}) for s in alive)
        table.ready.add(group.group_id)
        await self.pump()

    async def on_train_done(self, event: TrainDone) -> None:
        if not self.issuance.is_issued(Stage.TRAIN, event.batch_id, event.attempt, event.token, "completion"):
            return
        table = self.table
        batch = table.batch
        if batch is None or batch.batch_id != event.batch_id:
            self.metrics.counters["ignored_completions"] += 1
            return
        entered = max(s.entered_at[SlotState.TRAIN] for s in table.batch_members(batch))
        self._finish(Stage.TRAIN, batch.batch_id, entered)
        for group_id, reason in event.dropped:  # could not be trained: these go, the rest of the batch trained
            if group_id in batch.group_ids and group_id in table.groups:
                await self.drop_group(table.groups[group_id], f"train stage: {reason}")
        groups = [table.groups[g] for g in batch.group_ids if g in table.groups]
        members = [s for g in groups for s in table.members(g)]
        await table.save_meta(max(table.version, event.trainer_version), None)
        table.release(members)  # the admissions this call makes next take these slots: one write each, not two
        for group in groups:
            del table.groups[group.group_id]
            self.left.append(group.group_id)
        for s in members:
            self.metrics.record_lag(batch.trainer_version - s.version_floor)
        self.metrics.record_trained(table.now, len(members), len(groups))
        table.batch = None
        log.info("batch_trained", batch_id=batch.batch_id, num_groups=len(groups), policy_version=table.version)
        await self.drop_stale()
        await self.pump()

    async def on_failed(self, event: StageFailed) -> None:
        stage = Stage(event.stage)
        if not self.issuance.is_issued(stage, event.key, event.attempt, event.token, "failure"):
            return
        await self.retry(stage, event.key, reason=event.reason, count=True)
        await self.pump()

    # ------------------------------------------------------------------ retries, failures, drops
    async def retry(self, stage: Stage, key: str, *, reason: str, count: bool) -> None:
        table = self.table
        self.issuance.withdraw(stage, key)
        self.metrics.counters["retries"] += 1
        max_retries = self.scheduling.max_retries
        if stage in (Stage.ROLLOUT, Stage.REWARD):
            slot = table.by_sample(key)
            assert slot is not None, key
            if count and slot.num_retries >= max_retries:
                await self.fail_sample(slot, f"{reason} (after {slot.num_retries} retries)")
                return
            fresh = {"issued_version": table.version} if stage is Stage.ROLLOUT else {}
            (new,) = await self.bump([slot], count=count, **fresh)
            log.info("work_retried", stage=stage.value, sample_id=key, attempt=new.attempt, reason=reason)
            self.issuance.issue_sample(new, table.now)
            return
        if stage is Stage.GROUP:
            group = table.groups[key]
            alive = table.alive(group)
            if count and max(s.num_retries for s in alive) >= max_retries:
                await self.drop_group(group, f"group stage: {reason}")
                return
            await self.bump(alive, count=count)
            self.issue_group(group)
            return
        batch = table.batch
        assert batch is not None and batch.batch_id == key, (batch, key)
        # A batch is never retried for a counted failure nor dropped on a timeout: the trainer may
        # have trained it, and it answers every attempt of a batch id it decided with that decision.
        if count:  # the trainer rejected this batch id for good (see TrainOrder)
            for group_id in batch.group_ids:
                await self.drop_group(table.groups[group_id], f"train stage: {reason}")
            table.batch = None
            await table.save_meta(table.version, None)
            return
        await self.bump(table.batch_members(batch), count=count)
        self.issue_batch(batch)

    async def fail_sample(self, slot: Slot, reason: str) -> None:
        await self.table.write(slot.moved_to(SlotState.FAILED, self.table.now, failure_reason=reason))
        self.metrics.counters["failed_samples"] += 1
        log.warning("sample_failed", sample_id=slot.sample_id, stage=slot.state.value, reason=reason)
        await self.advance_group(self.table.groups[slot.group_id])

    async def advance_group(self, group: TableGroup) -> None:
        """Issue the group stage once every surviving sample is rewarded; apply the failed-group policy."""
        table = self.table
        members = table.members(group)
        failed = [s for s in members if s.state is SlotState.FAILED]
        alive = [s for s in members if s.state is not SlotState.FAILED]
        policy = self.scheduling.failed_group_policy
        if failed and (policy is FailedGroupPolicy.DROP_GROUP or len(alive) < self.scheduling.min_group_survivors):
            await self.drop_group(group, f"{len(failed)} sample(s) failed: {failed[0].failure_reason}")
            return
        if any(s.state is not SlotState.GROUP for s in alive) or self.issuance.is_pending(Stage.GROUP, group.group_id):
            return
        if failed:
            outcome = self._outcome(group, failed, dropped=False, reason="trained without failed samples")
            await table.put_outcome(outcome)
            await table.write_all(s.moved_to(SlotState.EMPTY, table.now) for s in failed)
            group.members = [s.index for s in alive]
            log.warning("group_trains_rest", group_id=group.group_id, num_failed=len(failed))
        self.issue_group(group)

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

    async def drop_group(self, group: TableGroup, reason: str) -> None:
        table = self.table
        members = table.members(group)
        failed = [s for s in members if s.state is SlotState.FAILED]
        await table.put_outcome(self._outcome(group, failed, dropped=True, reason=reason))
        for s in members:
            self.issuance.withdraw(Stage.ROLLOUT, s.sample_id)
            self.issuance.withdraw(Stage.REWARD, s.sample_id)
        self.issuance.withdraw(Stage.GROUP, group.group_id)
        await table.write_all(s.moved_to(SlotState.EMPTY, table.now) for s in members)
        del table.groups[group.group_id]
        self.left.append(group.group_id)
        table.ready.discard(group.group_id)
        self.metrics.counters["dropped_groups"] += 1
        log.warning("group_dropped", group_id=group.group_id, prompt_id=group.prompt_id, reason=reason)

    async def drop_stale(self, *, if_changed: bool = False) -> int:
        """Drop the groups past their deadline; ``if_changed``: only if the trainer version or eta changed
        since the last time (a tick's, see ``_stale_checked``)."""
        table, eta = self.table, self.scheduling.eta
        if if_changed and self._stale_checked == (table.version, eta):
            return 0
        self._stale_checked = (table.version, eta)
        training = set(table.batch.group_ids) if table.batch is not None else set()
        stale = [g for gid, g in table.groups.items() if gid not in training and self.deadline(g) < table.version]
        for group in stale:
            oldest = self.deadline(group) - eta
            reason = f"stale: oldest token version {oldest} + eta {eta} < trainer {table.version}"
            self.metrics.counters["stale_dropped_groups"] += 1
            await self.drop_group(group, reason)
        return len(stale)

    # ------------------------------------------------------------------ batches and admission
    async def pump(self) -> None:
        await self._hand_out_batch()
        await self._admit()

    async def _hand_out_batch(self) -> None:
        table, size = self.table, self.config.batch_size_groups
        final = self.cursor.is_exhausted
        if table.batch is not None or (len(table.ready) < size and not final):
            return
        decision = self._select_batch(final)
        if decision.due_running and self.scheduling.cut_stragglers:  # cut what the trainer would wait on, choose again
            for group_id in decision.due_running:
                await self.cut_stragglers(table.groups[group_id])
            decision = self._select_batch(final)
        if not decision.group_ids:
            if decision.wait is not BatchWait.NOT_ENOUGH_READY:
                self.metrics.record_batch_wait(decision.wait.value)
            return
        batch = TrainBatch(f"b{table.version}-{decision.group_ids[0]}", decision.group_ids, table.version)
        members = [s for g in batch.group_ids for s in table.members(table.groups[g])]
        assert all(table.version - s.version_floor <= self.scheduling.eta for s in members), batch
        await table.save_meta(table.version, batch)
        await table.write_all(s.moved_to(SlotState.TRAIN, table.now, batch_id=batch.batch_id) for s in members)
        table.ready.difference_update(batch.group_ids)
        table.batch = batch
        self.issue_batch(batch)

    def _select_batch(self, final: bool) -> BatchDecision:
        table = self.table
        views = [GroupView(self.deadline(g), gid, gid in table.ready) for gid, g in table.groups.items()]
        return select_batch(views, trainer_version=table.version, batch_size_groups=self.config.batch_size_groups,
                            final=final)

    async def cut_stragglers(self, group: TableGroup) -> None:
        """Fail the group's samples still rolling out or waiting for their reward: it is due at this version
        and a batch's worth of other groups is READY (`actors.reconciler.scheduling`, the bound on the wait).
        The group then trains what finished (the failed-group policy) or is dropped with its outcome."""
        table = self.table
        late = [s for s in table.members(group) if s.state in (SlotState.ROLLOUT, SlotState.REWARD)]
        if not late:
            return  # its group stage is in flight: a short wait, bounded by that stage's timeout
        eta, deadline = self.scheduling.eta, self.deadline(group)
        bound = (f"at trainer version {table.version}, the last its group may train at "
                 f"(oldest token {deadline - eta} + eta {eta})")
        for s in late:
            self.issuance.withdraw(Stage(s.state.value), s.sample_id)
        await table.write_all(
            s.moved_to(SlotState.FAILED, table.now, failure_reason=f"straggler: still in {s.state} {bound}")
            for s in late
        )
        self.metrics.counters["straggler_samples"] += len(late)
        log.info("stragglers_cut", group_id=group.group_id, sample_ids=[s.sample_id for s in late],
                 num_finished=sum(s.state is SlotState.GROUP for s in table.members(group)),
                 policy_version=table.version, deadline_version=deadline)
        await self.advance_group(group)

    async def _admit(self) -> None:
        table = self.table
        decision = admission(
            self.scheduling,
            batch_size_groups=self.config.batch_size_groups,
            group_size=self.config.group_size,
            num_live_groups=len(table.groups),
            num_ready_groups=len(table.ready),
            num_inflight_rollouts=table.count(SlotState.ROLLOUT),
            num_rollout_actors=self.num_rollout_actors,
            num_free_slots=table.num_free,
        )
        prompts = self.cursor.peek(decision.num_groups) if decision.num_groups else []
        if not prompts:
            self.metrics.record_admission(0, "exhausted" if decision.num_groups else decision.limit.value)
            return
        size = self.config.group_size
        new = [
            Slot.admitted(
                table.take_free(),
                prompt_id=p.prompt_id,
                epoch=p.epoch,
                position=p.position,
                index_in_group=j,
                trainer_version=table.version,
                now=table.now,
            )
            for p in prompts
            for j in range(size)
        ]
        await table.write_all(new)
        await self.cursor.advance_to(self.cursor.after(prompts[-1]))
        for k, p in enumerate(prompts):
            slots = new[k * size : (k + 1) * size]
            table.groups[slots[0].group_id] = TableGroup(
                slots[0].group_id, p.prompt_id, p.epoch, p.position, [s.index for s in slots]
            )
            for s in slots:
                self.issuance.issue_sample(s, table.now)
        self.metrics.record_admission(len(prompts), decision.limit.value)
