"""Resume of the lifecycle core: bring a table loaded from the store back to a consistent, running state.

Private part of `actors.lifecycle.Lifecycle` (`Lifecycle.resume` calls `_recover`). A crash can cut
any core call short after any of its writes; the durability rules of `actors.lifecycle` make every
such prefix recoverable: half-written admissions are rolled back, half-done drops, frees and moves
are completed, the batch in training is rebuilt from the meta record, and in-flight work is
re-issued with a new attempt (not counted as a retry).
"""

from __future__ import annotations

from actors._slot_table import TableGroup, TrainBatch
from actors.lifecycle_events import GroupOutcome
from actors.lifecycle_flow import LifecycleFlow
from actors.slot_store import outcome_key
from actors.slots import SlotState

__all__ = ["LifecycleRecovery"]


class LifecycleRecovery(LifecycleFlow):
    """The resume steps of the core."""

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
