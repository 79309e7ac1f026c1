"""The forward flow of samples through the slot table: completions, retries, drops, batches, admission.

Private part of `actors.lifecycle.Lifecycle` (which adds the public events, construction and
resume): each method here runs inside a core call (`SlotTable._run`), writes through
`SlotTable._write` before it issues the work a write implies, and leaves the orders in `_out`.
"""

from __future__ import annotations

import heapq

import structlog

from actors._slot_table import SlotTable, TableGroup, TrainBatch
from actors.lifecycle_events import GroupDone, GroupOutcome, RewardDone, RolloutDone, StageFailed, TrainDone
from actors.scheduling import BatchWait, FailedGroupPolicy, GroupView, admission, select_batch
from actors.slots import Slot, SlotState, Stage

__all__ = ["LifecycleFlow"]

log = structlog.get_logger(__name__)


class LifecycleFlow(SlotTable):
    """Moves samples forward on completions; retries, fails and drops; hands out batches; admits groups."""

    # ------------------------------------------------------------------ completions
    def _current_sample(self, stage: Stage, event: RolloutDone | RewardDone) -> Slot | None:
        if not self._is_issued(stage, event.sample_id, event.attempt, event.token, "completion"):
            return None
        index = self._by_sample.get(event.sample_id)
        slot = self._slots[index] if index is not None else None
        if slot is None or slot.state is not stage.state or slot.attempt != event.attempt:
            self.metrics.counters["ignored_completions"] += 1
            return None
        return slot

    async def _on_rollout_done(self, event: RolloutDone) -> None:
        slot = self._current_sample(Stage.ROLLOUT, event)
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
        slot = self._current_sample(Stage.REWARD, event)
        if slot is None:
            return
        self._finish(Stage.REWARD, slot.sample_id, slot.entered_at[SlotState.REWARD])
        new = slot.moved_to(SlotState.GROUP, self._now, blob_keys={**slot.blob_keys, "reward": event.result_key})
        await self._write(new)
        await self._advance_group(self._groups[new.group_id])

    async def _on_group_done(self, event: GroupDone) -> None:
        if not self._is_issued(Stage.GROUP, event.group_id, event.attempt, event.token, "completion"):
            return
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
        if not self._is_issued(Stage.TRAIN, event.batch_id, event.attempt, event.token, "completion"):
            return
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
        if not self._is_issued(stage, event.key, event.attempt, event.token, "failure"):
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
