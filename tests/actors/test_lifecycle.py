"""Scenario tests of the lifecycle core (the property tests cover arbitrary interleavings)."""

from __future__ import annotations

import dataclasses

import pytest

from actors import (
    CasConflict,
    CoreBroken,
    FailedGroupPolicy,
    GroupOrder,
    GroupOutcome,
    Lifecycle,
    LifecycleConfig,
    ListTaskSource,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    SchedulingConfig,
    SlotState,
    StageFailed,
    TrainDone,
    TrainOrder,
)
from actors.reconciler.slot import Stage
from actors.reconciler.store import META_KEY, outcome_key
from actors.reconciler.work import MetaRecord
from actors.testing import InMemorySlotStore
from tests.actors.lifecycle_world import World

pytestmark = pytest.mark.usefixtures("quiet_logs")




def config(**scheduling) -> LifecycleConfig:
    sched = {"eta": 1, "max_retries": 1, "rollout_timeout_s": 10.0, "min_group_survivors": 1, **scheduling}
    return LifecycleConfig(
        num_slots=8,
        group_size=2,
        batch_size_groups=2,
        scheduling=SchedulingConfig(**sched),
        transition_events_per_s=0,
    )


async def start(store=None, num_prompts: int = 6, **scheduling):
    store = store or InMemorySlotStore()
    resumed = await Lifecycle.resume(
        store, ListTaskSource.numbered(num_prompts), config(**scheduling), 0.0, num_rollout_actors=4
    )
    world = World()
    world.add(resumed.orders, resumed.lifecycle.scheduling.eta)
    return store, resumed, world


async def deliver(core: Lifecycle, world: World, order, now: float = 1.0) -> None:
    world.pending.remove(order)
    world.add(await core.on_completion(world.complete(order), now), core.scheduling.eta)


async def run_all(core: Lifecycle, world: World, now: float = 1.0) -> None:
    while world.pending:
        await deliver(core, world, world.pending[0], now)


async def test_runs_every_prompt_once_within_the_bound() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    assert len(resumed.orders) == 8 and all(isinstance(o, RolloutOrder) for o in resumed.orders)  # (η+1)·B groups
    await run_all(core, world)
    assert core.is_finished and core.trainer_version == 3
    assert world.trainer.trained_groups == {f"e0-p{i}" for i in range(6)}
    snap = core.snapshot(2.0)
    assert snap.counters["trained_samples"] == 12 and snap.slots_per_state["empty"] == 8
    assert set(snap.stage_latency) == {"rollout", "reward", "group", "train"}
    assert sum(snap.lag_histogram.values()) == 12 and max(snap.lag_histogram) <= 1
    assert snap.admissions["admitted"] == 6 and "to_dict" in dir(snap)


async def test_a_group_is_live_while_any_of_its_samples_holds_a_slot() -> None:
    _, resumed, world = await start(max_retries=0)
    core = resumed.lifecycle

    def live_by_slots() -> set[str]:
        return {s.group_id for s in core.slots if s.is_live}

    groups = {f"e0-p{i}" for i in range(6)} | {"e1-p0", "e0-p1-s0"}
    assert {g for g in groups if core.is_live_group(g)} == live_by_slots() == {f"e0-p{i}" for i in range(4)}
    victim = next(o for o in world.pending if o.sample_id == "e0-p0-s0")  # failed: still holds its slot
    world.pending.remove(victim)
    failed = StageFailed(victim.STAGE, victim.key, victim.attempt, "x", victim.token)
    world.add(await core.on_completion(failed, 1.0), 1)
    while world.pending:
        await deliver(core, world, world.pending[0])
        assert {g for g in groups if core.is_live_group(g)} == live_by_slots()
    assert not any(core.is_live_group(g) for g in groups)


async def test_duplicates_and_stale_attempts_are_ignored() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    order = world.pending[0]
    done = world.complete(order)
    first = await core.on_completion(done, 1.0)
    assert [type(o) for o in first] == [RewardOrder]
    assert await core.on_completion(done, 1.0) == []
    assert await core.on_completion(dataclasses.replace(done, attempt=7), 1.0) == []
    assert core.snapshot(1.0).counters["ignored_completions"] == 2


async def test_timeouts_retry_then_fail_and_drop_the_group() -> None:
    store, resumed, world = await start(failed_group_policy=FailedGroupPolicy.DROP_GROUP)
    core = resumed.lifecycle
    retried = await core.tick(11.0)  # every rollout timed out: attempt 1
    assert {o.attempt for o in retried} == {1} and len(retried) == 8
    late = world.complete(world.pending[0])  # attempt 0 arrives after the retry: ignored
    assert await core.on_completion(late, 11.5) == []
    orders = await core.tick(22.0)  # retries exhausted: every sample fails, groups dropped
    assert core.snapshot(22.0).counters["dropped_groups"] == 4
    outcome = GroupOutcome.decode((await store.get(outcome_key("e0-p0"))).value)
    assert outcome.dropped and "timed out" in outcome.reason and len(outcome.failed_samples) >= 1
    assert {o.group_id for o in orders} == {"e0-p4", "e0-p5"}  # the freed slots admit the next prompts


async def test_train_rest_trains_survivors_and_records_the_failure() -> None:
    store, resumed, world = await start(max_retries=0)
    core = resumed.lifecycle
    victim = next(o for o in world.pending if o.sample_id == "e0-p0-s0")
    world.pending.remove(victim)
    failed = StageFailed(victim.STAGE, victim.key, victim.attempt, "boom", victim.token)
    world.add(await core.on_completion(failed, 1.0), 1)
    await run_all(core, world)
    assert "e0-p0" in world.trainer.trained_groups and "e0-p0-s0" not in world.trainer.trained_samples
    outcome = GroupOutcome.decode((await store.get(outcome_key("e0-p0"))).value)
    assert not outcome.dropped and outcome.failed_samples == {"e0-p0-s0": "boom (after 0 retries)"}


async def _half_done(**scheduling):
    """A core with groups 0 and 1 past their rollouts (0 READY, 1's rewards in flight), the rest rolling out."""
    store, resumed, world = await start(**scheduling)
    core = resumed.lifecycle
    for order in [o for o in world.pending if o.sample_id.startswith(("e0-p0", "e0-p1"))]:
        await deliver(core, world, order)  # reward orders for groups 0 and 1 now pending
    rewards = [o for o in world.pending if isinstance(o, RewardOrder)]
    for order in [o for o in rewards if o.group_id == "e0-p0"]:
        await deliver(core, world, order)
    group_order = next(o for o in world.pending if isinstance(o, GroupOrder))
    await deliver(core, world, group_order)  # e0-p0 READY
    return store, world


async def test_resume_without_adoption_reissues_in_flight_work_with_new_attempts() -> None:
    store, world = await _half_done(adopt_on_resume=False)
    again = await Lifecycle.resume(store, ListTaskSource.numbered(6), config(adopt_on_resume=False), 5.0,
                                   num_rollout_actors=4)
    assert again.num_rolled_back_slots == 0 and again.num_discarded_groups == 0 and again.num_adopted == 0
    kinds = sorted((type(o).__name__, o.attempt) for o in again.orders)
    assert kinds == [("RewardOrder", 1)] * 2 + [("RolloutOrder", 1)] * 4
    for old in list(world.pending):  # pre-crash attempts are ignored by the new core
        assert await again.lifecycle.on_completion(world.complete(old), 6.0) == []
    world.pending.clear()
    world.add(again.orders, 1)
    await run_all(again.lifecycle, world, 7.0)
    assert again.lifecycle.is_finished and len(world.trainer.trained_groups) == 6


async def test_resume_adopts_in_flight_work_and_accepts_the_old_attempts_completions() -> None:
    store, world = await _half_done()
    again = await Lifecycle.resume(store, ListTaskSource.numbered(6), config(), 5.0, num_rollout_actors=4)
    assert again.num_adopted == 6 and again.num_reissued == 0 and again.orders == (), "nothing re-issued"
    core = again.lifecycle
    assert all(core.is_current(o.STAGE, o.key, o.attempt) for o in world.pending)
    forged = dataclasses.replace(world.complete(world.pending[0]), token="forged")
    assert await core.on_completion(forged, 5.5) == [] and core.snapshot(5.5).counters["rejected_reports"] == 1
    await run_all(core, world, 6.0)  # the attempts issued before the crash finish the run: nothing done twice
    assert core.is_finished and len(world.trainer.trained_groups) == 6


async def test_adopted_work_nobody_owns_up_to_is_reissued_after_the_grace_not_counted() -> None:
    store, world = await _half_done()
    again = await Lifecycle.resume(store, ListTaskSource.numbered(6), config(adopt_grace_s=3.0), 5.0,
                                   num_rollout_actors=4)
    core = again.lifecycle
    alive, dead = world.pending[0], world.pending[1:]
    core.on_heartbeat(alive.STAGE, alive.key, alive.attempt, "rollout-1", 6.0, alive.token)  # its actor lived
    assert await core.tick(7.9) == [], "within the grace nothing is re-issued"
    reissued = await core.tick(8.1)
    assert sorted((o.key, o.attempt) for o in reissued) == sorted((o.key, o.attempt + 1) for o in dead)
    assert all(o.policy_version_floor == core.trainer_version for o in reissued if isinstance(o, RolloutOrder))
    assert core.is_current(alive.STAGE, alive.key, alive.attempt), "the confirmed attempt stays"
    for old in dead:  # superseded: their late completions change nothing
        assert await core.on_completion(world.complete(old), 8.2) == []
    assert core.snapshot(8.2).counters["adopted_reissued"] == len(dead)
    assert all(s.num_retries == 0 for s in core.slots), "a re-issue after a resume is not a retry"
    world.pending[:] = [alive]
    world.add(reissued, 1)
    await run_all(core, world, 9.0)
    assert core.is_finished and len(world.trainer.trained_groups) == 6


async def test_a_rollout_adopted_too_stale_to_train_is_reissued_at_once_with_a_fresh_floor() -> None:
    store, _ = await _half_done()
    meta = await store.get(META_KEY)  # the trainer moved 2 versions on while the reconciler was down (eta 1)
    await store.update(META_KEY, MetaRecord(trainer_version=2).encode(), meta.revision)
    again = await Lifecycle.resume(store, ListTaskSource.numbered(6), config(), 5.0, num_rollout_actors=4)
    rollouts = [o for o in again.orders if isinstance(o, RolloutOrder) and o.group_id in ("e0-p2", "e0-p3")]
    assert again.num_discarded_groups == 2, "groups 0 and 1 hold tokens of version 0: too stale"
    assert again.num_adopted == 0 and {o.policy_version_floor for o in rollouts} == {2} and len(rollouts) == 4


async def test_resume_discards_ready_groups_past_the_bound() -> None:
    store, resumed, world = await start(num_prompts=2)
    core = resumed.lifecycle
    for order in [o for o in world.pending if o.group_id == "e0-p0"]:
        await deliver(core, world, order)
    while any(isinstance(o, (RewardOrder, GroupOrder)) for o in world.pending):
        await deliver(core, world, next(o for o in world.pending if isinstance(o, (RewardOrder, GroupOrder))))
    assert any(s.state is SlotState.READY for s in core.slots)
    # the whole run restarts with a trainer checkpoint 5 versions on (written by another process)
    meta = await store.get(META_KEY)
    await store.update(META_KEY, MetaRecord(trainer_version=5).encode(), meta.revision)
    again = await Lifecycle.resume(store, ListTaskSource.numbered(2), config(), 3.0, num_rollout_actors=4)
    assert again.num_discarded_groups == 1 and again.lifecycle.trainer_version == 5
    assert [o.group_id for o in again.orders] == ["e0-p1"] * 2  # in-flight work re-issued, fresh floor
    assert {o.policy_version_floor for o in again.orders} == {5}
    snap = again.lifecycle.snapshot(3.0)
    assert snap.counters["discarded_on_resume"] == 1 and snap.slots_per_state["ready"] == 0


async def test_rollout_with_tokens_older_than_the_bound_is_retried() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    order = world.pending[0]
    await core.on_trainer_version(1, 1.0)
    too_old = RolloutDone(order.sample_id, order.attempt, "k", -1, 0, order.token)
    (retry,) = await core.on_completion(too_old, 2.0)
    assert isinstance(retry, RolloutOrder) and retry.attempt == 1 and retry.policy_version_floor == 1


async def test_lowering_eta_drops_what_is_already_too_stale() -> None:
    _, resumed, _ = await start(eta=2)
    core = resumed.lifecycle
    await core.on_trainer_version(2, 1.0)
    await core.update_scheduling(dataclasses.replace(core.scheduling, eta=1), 2.0)
    assert core.snapshot(2.0).counters["stale_dropped_groups"] == 4  # the slots held 4 groups
    with pytest.raises(ValueError, match="no batch could ever form"):
        await core.update_scheduling(dataclasses.replace(core.scheduling, max_ready_groups=1), 3.0)


async def test_rollout_cap_follows_live_actors() -> None:
    store = InMemorySlotStore()
    resumed = await Lifecycle.resume(store, ListTaskSource.numbered(6), config(max_inflight_per_rollout_actor=2), 0.0)
    assert resumed.orders == ()
    assert len(await resumed.lifecycle.set_rollout_actors(2, 1.0)) == 4
    assert resumed.lifecycle.snapshot(1.0).admissions["blocked_inflight_cap"] >= 1


async def test_second_writer_breaks_the_first() -> None:
    store, resumed, world = await start()
    first = resumed.lifecycle
    second = await Lifecycle.resume(store, ListTaskSource.numbered(6), config(), 1.0, num_rollout_actors=4)
    assert second.num_adopted == len(world.pending)  # it adopted the work in flight (and wrote its slots again)
    order = world.pending[0]
    # a completion of the first core's own order (its attempt and token) for that sample
    stale_for_first = world.complete(next(o for o in world.pending if o.key == order.key))
    with pytest.raises(CasConflict):
        await first.on_completion(stale_for_first, 2.0)
    with pytest.raises(CoreBroken):
        await first.tick(3.0)


async def test_trainer_rejection_drops_the_batch() -> None:
    store, resumed, world = await start(num_prompts=2)
    core = resumed.lifecycle
    while not any(isinstance(o, TrainOrder) for o in world.pending):
        await deliver(core, world, world.pending[0])
    batch = next(o for o in world.pending if isinstance(o, TrainOrder))
    (reissued,) = await core.tick(1e6)
    assert reissued == dataclasses.replace(batch, attempt=1, token=reissued.token)  # timeouts re-issue, never drop
    assert reissued.token != batch.token, "a new attempt gets a new issuance token"
    await core.on_completion(StageFailed(batch.STAGE, batch.key, 1, "nan loss", reissued.token), 2.0)
    assert core.is_finished and core.snapshot(2.0).counters["dropped_groups"] == 2
    assert "nan loss" in GroupOutcome.decode((await store.get(outcome_key("e0-p0"))).value).reason


async def test_a_group_the_trainer_could_not_read_is_dropped_alone_and_the_rest_of_its_batch_trains() -> None:
    store, resumed, world = await start(num_prompts=2)
    core = resumed.lifecycle
    while not any(isinstance(o, TrainOrder) for o in world.pending):
        await deliver(core, world, world.pending[0])
    batch = next(o for o in world.pending if isinstance(o, TrainOrder))
    corrupt, healthy = batch.group_ids
    why = f"blob 'groups/{corrupt}/a0' is corrupt; this group is dropped, the rest of its batch trains"
    await core.on_completion(TrainDone(batch.batch_id, batch.attempt, 1, batch.token, dropped=((corrupt, why),)), 2.0)
    counters = core.snapshot(2.0).counters
    assert core.is_finished and counters["dropped_groups"] == 1 and counters["trained_groups"] == 1
    outcome = GroupOutcome.decode((await store.get(outcome_key(corrupt))).value)
    assert outcome.dropped and outcome.reason == f"train stage: {why}"
    assert await store.get(outcome_key(healthy)) is None, "the healthy group trained: no drop recorded"
    assert core.snapshot(2.0).trainer_version == 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="cannot hold one batch"):
        LifecycleConfig(num_slots=3, group_size=2, batch_size_groups=2)


async def test_a_lost_actors_work_is_reissued_at_once_and_its_old_attempts_are_no_longer_current() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    held, other = world.pending[0], world.pending[1]
    core.on_heartbeat(Stage.ROLLOUT, held.key, held.attempt, "rollout-1", 1.0, held.token)
    core.on_heartbeat(Stage.ROLLOUT, other.key, other.attempt, "rollout-2", 1.0, other.token)
    assert core.is_current(Stage.ROLLOUT, held.key, held.attempt)
    reissued = await core.on_actor_lost("rollout-1", 2.0)  # long before rollout_timeout_s (10 s)
    assert [(o.key, o.attempt) for o in reissued] == [(held.key, held.attempt + 1)]
    assert not core.is_current(Stage.ROLLOUT, held.key, held.attempt), "the old attempt is superseded"
    assert core.is_current(Stage.ROLLOUT, held.key, held.attempt + 1)
    assert core.is_current(Stage.ROLLOUT, other.key, other.attempt), "another actor's work is untouched"
    await deliver(core, world, other)
    assert not core.is_current(Stage.ROLLOUT, other.key, other.attempt), "completed work is not current"
