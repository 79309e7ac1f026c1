"""Resume of the lifecycle core: bring a table loaded from the store back to a consistent, running state.

A crash can cut any core call short after any of its writes; the durability rules of
`actors.reconciler.lifecycle` make every such prefix recoverable: half-written admissions are rolled
back, half-done drops, frees and moves are completed, the batch in training is rebuilt from the meta
record. Rollout and reward attempts in flight are adopted (`Issuance.adopt`: their actors may have
lived through the crash, and their completions count as if the core had never stopped), unless
``adopt_on_resume`` is off or a rollout's version floor is already too stale to train; adopted work
no actor owns up to (a heartbeat) within ``adopt_grace_s`` is re-issued by `reissue_unconfirmed`
(where a rollout resumes from its checkpoints: actors.rollout_checkpoint). The other work in flight
is re-issued with a new attempt (not counted as a retry). `recover` works through the flow's parts
(`LifecycleFlow`, its table and issuance) like any other core call.
"""

from __future__ import annotations

from actors.reconciler.flow import LifecycleFlow
from actors.reconciler.slot import Slot, SlotState
from actors.reconciler.table import TableGroup, TrainBatch

__all__ = ["recover", "reissue_unconfirmed"]


async def recover(flow: LifecycleFlow) -> dict[str, int]:
    """Resume steps over a freshly loaded table; returns the counts `Resumption` reports."""
    table, cursor = flow.table, flow.cursor
    half_admitted = [s for s in table.slots if s.is_live and not cursor.admitted(s.epoch, s.position)]
    await table.write_all(s.moved_to(SlotState.EMPTY, table.now) for s in half_admitted)
    for s in table.slots:
        if s.is_live:
            group = table.groups.get(s.group_id)
            if group is None:
                group = table.groups[s.group_id] = TableGroup(s.group_id, s.prompt_id, s.epoch, s.position, [])
            group.members.append(s.index)
    num_dropped = await _finish_interrupted(flow)
    await _restore_batch(flow)
    training = table.batch.group_ids if table.batch is not None else ()
    num_reissued = num_adopted = 0
    for group in list(table.groups.values()):
        if group.group_id not in training:
            reissued, adopted = await _reissue(flow, group)
            num_reissued, num_adopted = num_reissued + reissued, num_adopted + adopted
    if table.batch is not None:
        await flow.bump(table.batch_members(table.batch), count=False)
        flow.issue_batch(table.batch)
        num_reissued += 1
    await flow.pump()
    if table.fenced_by_any_write:  # one write of this core refuses every later one of an older core
        await table.save_meta(table.version, table.batch)
    return {
        "num_rolled_back_slots": len(half_admitted),
        "num_discarded_groups": num_dropped,
        "num_reissued": num_reissued,
        "num_adopted": num_adopted,
    }


async def reissue_unconfirmed(flow: LifecycleFlow, now: float) -> None:
    """Re-issue (not counted) the adopted work that no actor owned up to within ``adopt_grace_s``."""
    grace_s = flow.scheduling.adopt_grace_s
    for stage, key in flow.issuance.unconfirmed(now, grace_s):
        if not flow.issuance.is_pending(stage, key):  # withdrawn by an earlier one's effects
            continue
        flow.metrics.counters["adopted_reissued"] += 1
        await flow.retry(stage, key, reason=f"adopted on resume, no actor heard of in {grace_s:.1f}s", count=False)


async def _finish_interrupted(flow: LifecycleFlow) -> int:
    """Complete drops, frees and moves a crash cut short; discard groups now too stale to train."""
    table = flow.table
    num_dropped = 0
    outcomes = await table.outcomes()
    for group in list(table.groups.values()):
        outcome = outcomes.get(group.group_id)
        if outcome is not None and outcome.dropped:
            await flow.drop_group(group, outcome.reason + " (completed on resume)")
            continue
        members = table.members(group)
        states = {s.state for s in members}
        if SlotState.TRAIN in states and group.group_id not in table.meta.batch_group_ids:
            # the batch was trained (meta is cleared before a trained batch's slots are freed)
            await table.write_all(s.moved_to(SlotState.EMPTY, table.now) for s in members)
            del table.groups[group.group_id]
            continue
        if SlotState.READY in states and SlotState.GROUP in states:
            keys = {"group": next(s.blob_keys["group"] for s in members if s.state is SlotState.READY)}
            await table.write_all(
                s.moved_to(SlotState.READY, table.now, blob_keys={**s.blob_keys, **keys})
                for s in members
                if s.state is SlotState.GROUP
            )
        alive = table.alive(group)
        refreshed = [table.version if s.state is SlotState.ROLLOUT else s.version_floor for s in alive]
        in_batch = group.group_id in table.meta.batch_group_ids
        if not in_batch and alive and min(refreshed) + flow.scheduling.eta < table.version:
            num_dropped += 1
            flow.metrics.counters["discarded_on_resume"] += 1
            await flow.drop_group(group, f"stale on resume: oldest token version {min(refreshed)}")
    return num_dropped


async def _restore_batch(flow: LifecycleFlow) -> None:
    """Rebuild the batch in training from the meta record, finishing its READY → TRAIN moves."""
    table = flow.table
    meta = table.meta
    if not meta.batch_id:
        return
    group_ids = tuple(g for g in meta.batch_group_ids if g in table.groups)
    if not group_ids:
        await table.save_meta(table.version, None)
        return
    for group_id in group_ids:
        members = table.members(table.groups[group_id])
        await table.write_all(
            s.moved_to(SlotState.TRAIN, table.now, batch_id=meta.batch_id)
            for s in members
            if s.state is SlotState.READY
        )
    table.batch = TrainBatch(meta.batch_id, group_ids, meta.batch_version)


async def _reissue(flow: LifecycleFlow, group: TableGroup) -> tuple[int, int]:
    """Adopt or re-issue a group's in-flight work (see the module); returns (re-issued, adopted)."""
    table = flow.table
    members = table.members(group)
    if all(s.state is SlotState.READY for s in members):
        table.ready.add(group.group_id)
        return 0, 0
    num = num_adopted = 0
    for slot in members:
        if slot.state in (SlotState.ROLLOUT, SlotState.REWARD):
            if _adoptable(flow, slot):
                # unchanged, but a new revision: a core still running elsewhere is fenced off (a store fenced by
                # any write needs none of these: `recover` writes the meta record once)
                if not table.fenced_by_any_write:
                    await table.write(slot)
                flow.issuance.adopt(slot, table.now)
                num_adopted += 1
                continue
            fresh = {"issued_version": table.version} if slot.state is SlotState.ROLLOUT else {}
            (new,) = await flow.bump([slot], count=False, **fresh)
            flow.issuance.issue_sample(new, table.now)
            num += 1
    alive = table.alive(group)
    if alive and all(s.state is SlotState.GROUP for s in alive) and len(alive) == len(members):
        await flow.bump(alive, count=False)
        num += 1
    await flow.advance_group(group)
    return num, num_adopted


def _adoptable(flow: LifecycleFlow, slot: Slot) -> bool:
    """A rollout whose floor is still trainable, or a reward (its tokens are already judged), when adopting."""
    if not flow.scheduling.adopt_on_resume or not slot.token:
        return False
    return slot.state is SlotState.REWARD or slot.issued_version + flow.scheduling.eta >= flow.table.version
