"""The bound on the trainer's wait for a group due now: its stragglers are cut, not waited on.

A group whose oldest tokens reach the staleness bound at this trainer version is due: it trains in
this version's batch or never. While a batch's worth of other groups is READY, the lifecycle does not
hold the trainer (and, through the admission bound, every new group) behind the due group's slowest
episode: the samples still rolling out or awaiting their reward fail as stragglers, and the group
trains what finished (the failed-group policy) within the bound, or is dropped with its outcome.
"""

from __future__ import annotations

import pytest

from actors import (
    GroupOrder,
    GroupOutcome,
    Lifecycle,
    LifecycleConfig,
    ListTaskSource,
    RewardOrder,
    RolloutOrder,
    SchedulingConfig,
    SlotState,
    TrainOrder,
)
from actors.reconciler.scheduling import BatchWait, GroupView, select_batch
from actors.reconciler.store import outcome_key
from actors.testing import InMemorySlotStore
from tests.actors.lifecycle_world import World

pytestmark = pytest.mark.usefixtures("quiet_logs")




async def start(*, eta: int = 1, min_group_survivors: int = 1, cut_stragglers: bool = True):
    """Four groups of two samples, batches of two groups, at eta (slots for (eta + 1) batches)."""
    scheduling = SchedulingConfig(eta=eta, min_group_survivors=min_group_survivors, max_inflight_per_rollout_actor=8,
                                  cut_stragglers=cut_stragglers)
    config = LifecycleConfig(num_slots=4 * (eta + 1), group_size=2, batch_size_groups=2, scheduling=scheduling,
                             transition_events_per_s=0)
    store = InMemorySlotStore()
    resumed = await Lifecycle.resume(store, ListTaskSource.numbered(10), config, 0.0, num_rollout_actors=1)
    world = World()
    world.add(resumed.orders, eta)
    return store, resumed.lifecycle, world


async def finish(core: Lifecycle, world: World, *, sample_ids: tuple[str, ...] = (), group_ids: tuple[str, ...] = (),
                 now: float = 1.0) -> None:
    """Deliver every pending order of these samples and groups (their rewards and group orders too), and train."""

    def mine(order) -> bool:
        if isinstance(order, RolloutOrder | RewardOrder):
            return order.sample_id in sample_ids or order.group_id in group_ids
        return (isinstance(order, GroupOrder) and order.group_id in group_ids) or isinstance(order, TrainOrder)

    while (order := next((o for o in world.pending if mine(o)), None)) is not None:
        world.pending.remove(order)
        world.add(await core.on_completion(world.complete(order), now), core.scheduling.eta)


def test_a_due_group_still_running_is_named_once_a_batch_is_ready() -> None:
    groups = [GroupView(2, "slow", False), GroupView(3, "a", True), GroupView(3, "b", True), GroupView(4, "c", False)]
    decision = select_batch(groups, trainer_version=2, batch_size_groups=2, final=False)
    assert (decision.group_ids, decision.wait, decision.due_running) == ((), BatchWait.DUE_GROUP_RUNNING, ("slow",))
    one_ready = select_batch(groups[:2], trainer_version=2, batch_size_groups=2, final=False)
    assert one_ready.wait is BatchWait.NOT_ENOUGH_READY and one_ready.due_running == ()


async def test_a_due_group_s_straggler_is_cut_and_the_group_trains_what_finished_within_the_bound() -> None:
    store, core, world = await start(eta=1)
    await finish(core, world, group_ids=("e0-p0", "e0-p1"))  # trained at version 0
    assert core.trainer_version == 1 and world.trainer.trained_groups == {"e0-p0", "e0-p1"}
    # e0-p2 and e0-p3 hold tokens of version 0: due at version 1. e0-p2's second sample is slow.
    await finish(core, world, sample_ids=("e0-p2-s0",), group_ids=("e0-p3",))
    assert not any(isinstance(o, TrainOrder) for o in world.pending), "one READY group is no batch: the wait goes on"
    assert core.snapshot(1.0).counters.get("straggler_samples", 0) == 0
    await finish(core, world, group_ids=("e0-p4",))  # admitted at version 1: a batch's worth is READY now
    assert core.snapshot(1.0).counters["straggler_samples"] == 1
    straggler = next(o for o in world.pending if isinstance(o, RolloutOrder) and o.sample_id == "e0-p2-s1")
    assert not core.is_current(straggler.STAGE, straggler.key, straggler.attempt), "its completion no longer counts"
    await finish(core, world, group_ids=("e0-p2",))  # its group stage, then the batch of the two due groups
    assert {"e0-p2", "e0-p3"} <= world.trainer.trained_groups and core.trainer_version == 2
    assert "e0-p2-s0" in world.trainer.trained_samples and "e0-p2-s1" not in world.trainer.trained_samples
    assert world.trainer.max_lag_seen <= 1  # the fake trainer recomputes staleness from the data it trains
    assert await core.on_completion(world.complete(straggler), 2.0) == []  # the slow episode ends after all
    outcome = GroupOutcome.decode((await store.get(outcome_key("e0-p2"))).value)
    assert not outcome.dropped and outcome.failed_samples["e0-p2-s1"].startswith("straggler: still in rollout")


async def test_a_due_group_with_too_few_finished_samples_is_dropped_and_its_slots_admit_new_prompts() -> None:
    store, core, world = await start(eta=1, min_group_survivors=2)
    await finish(core, world, group_ids=("e0-p0", "e0-p1"))
    await finish(core, world, sample_ids=("e0-p2-s0",), group_ids=("e0-p3", "e0-p4"))
    outcome = GroupOutcome.decode((await store.get(outcome_key("e0-p2"))).value)
    assert outcome.dropped and "straggler" in outcome.reason
    assert not any(s.group_id == "e0-p2" for s in core.slots if s.state is not SlotState.EMPTY)
    new = {o.group_id for o in world.pending if isinstance(o, RolloutOrder)}
    assert "e0-p6" in new, new  # the dropped group's slots went to the next prompt


async def test_by_default_the_trainer_waits_for_a_due_group_and_cuts_nothing() -> None:
    _, core, world = await start(eta=1, cut_stragglers=False)
    await finish(core, world, group_ids=("e0-p0", "e0-p1"))
    await finish(core, world, sample_ids=("e0-p2-s0",), group_ids=("e0-p3", "e0-p4"))  # a batch's worth READY
    assert not any(isinstance(o, TrainOrder) for o in world.pending), "the due group e0-p2 is waited for"
    assert core.snapshot(1.0).counters.get("straggler_samples", 0) == 0
    await finish(core, world, group_ids=("e0-p2",))  # its slow episode ends: the due groups train, nothing lost
    assert {"e0-p2", "e0-p3"} <= world.trainer.trained_groups
    assert "e0-p2-s1" in world.trainer.trained_samples
