"""Property tests of the lifecycle core under arbitrary interleavings (hypothesis stateful testing).

Any sequence of completions (in any order), duplicates, reported failures, lost messages,
timeouts, live config changes, reconciler crashes (the in-memory core dropped and rebuilt from
the store) and crashes part-way through a call (the store fails after k writes) must keep:

- no sample and no group trained twice, each trained batch at most once;
- staleness at training time (trainer version − oldest token version, recomputed by the fake
  trainer from the data) never above eta;
- the dataset cursor the exact boundary of admitted prompts: every prompt before it is live in
  the table, trained, or dropped with a recorded reason, exactly one of these; none after it;
- at the end, after delivering everything: every prompt trained or dropped with a reason, and
  none dropped for staleness unless eta was lowered (finished work is never discarded).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors import (
    FailedGroupPolicy,
    GroupOutcome,
    Lifecycle,
    LifecycleConfig,
    ListTaskSource,
    SchedulingConfig,
    Slot,
)
from actors.reconciler.store import CURSOR_KEY, OUTCOME_PREFIX, SLOT_PREFIX
from actors.reconciler.task_cursor import CursorRecord
from actors.testing import InjectedStoreFailure, InMemorySlotStore
from tests.actors.lifecycle_world import World

pytestmark = pytest.mark.usefixtures("quiet_logs")

NUM_PROMPTS = 7
TIMEOUT_S = 10.0


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store = InMemorySlotStore()
        self.source = ListTaskSource.numbered(NUM_PROMPTS)
        self.world = World()
        self.now = 0.0
        self.eta_lowered = False
        self.core: Lifecycle | None = None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            if self.core is not None:
                self.drain_to_completion()
        finally:
            self.loop.close()

    # ------------------------------------------------------------------ setup
    @initialize(
        eta=st.integers(0, 3),
        group_size=st.integers(1, 3),
        batch_size=st.integers(1, 2),
        extra_slots=st.integers(0, 4),
        policy=st.sampled_from(FailedGroupPolicy),
        max_retries=st.integers(0, 2),
        num_actors=st.integers(1, 3),
        adopt=st.booleans(),
    )
    def setup(self, eta, group_size, batch_size, extra_slots, policy, max_retries, num_actors, adopt) -> None:
        scheduling = SchedulingConfig(
            eta=eta,
            max_retries=max_retries,
            failed_group_policy=policy,
            min_group_survivors=1,
            max_inflight_per_rollout_actor=2,
            rollout_timeout_s=TIMEOUT_S,
            reward_timeout_s=TIMEOUT_S,
            group_timeout_s=TIMEOUT_S,
            train_timeout_s=TIMEOUT_S,
            adopt_on_resume=adopt,  # a resume adopts the work in flight (its old orders may still complete)
            adopt_grace_s=TIMEOUT_S / 2,
        )
        self.config = LifecycleConfig(
            num_slots=group_size * batch_size + extra_slots,
            group_size=group_size,
            batch_size_groups=batch_size,
            scheduling=scheduling,
            transition_events_per_s=0,
        )
        self.num_actors = num_actors
        self.resume()

    def resume(self) -> None:
        self.store.fail_after(None)
        if self.core is not None:  # a restarted reconciler reads the live config bucket
            self.config = dataclasses.replace(self.config, scheduling=self.core.scheduling)
        for _ in range(3):  # let writes a crashed call left in flight land first
            self.run(asyncio.sleep(0))
        resumed = self.run(
            Lifecycle.resume(self.store, self.source, self.config, self.now, num_rollout_actors=self.num_actors)
        )
        self.core = resumed.lifecycle
        self.add(resumed.orders)

    def add(self, orders) -> None:
        assert self.core is not None
        self.world.add(orders, self.core.scheduling.eta)

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.world.pending)
    @rule(index=st.integers(0, 1000), version_offset=st.integers(0, 2))
    def complete(self, index: int, version_offset: int) -> None:
        order = self.world.take(index)
        completion = self.world.complete(order, version_offset)
        self.world.delivered.append(completion)
        self.add(self.run(self.core.on_completion(completion, self.now)))

    @precondition(lambda self: self.world.pending)
    @rule(count=st.integers(1, 8))
    def complete_in_order(self, count: int) -> None:
        """Deliver the oldest outstanding work first, as a healthy system mostly does."""
        for _ in range(min(count, len(self.world.pending))):
            self.complete(0, 0)

    @precondition(lambda self: self.world.pending)
    @rule(index=st.integers(0, 1000))
    def fail(self, index: int) -> None:
        order = self.world.take(index)
        completion = self.world.failure(order)
        self.world.delivered.append(completion)
        self.add(self.run(self.core.on_completion(completion, self.now)))

    @precondition(lambda self: self.world.pending)
    @rule(index=st.integers(0, 1000))
    def lose_message(self, index: int) -> None:
        self.world.take(index)

    @precondition(lambda self: self.world.delivered)
    @rule(index=st.integers(0, 1000))
    def redeliver(self, index: int) -> None:
        completion = self.world.delivered[index % len(self.world.delivered)]
        self.add(self.run(self.core.on_completion(completion, self.now)))

    @rule(dt=st.sampled_from([0.5, 3.0, TIMEOUT_S + 1]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.add(self.run(self.core.tick(self.now)))

    @rule()
    def weights_published(self) -> None:
        self.add(self.run(self.core.on_trainer_version(self.world.trainer.version, self.now)))

    @rule(num_actors=st.integers(0, 3))
    def rollout_actors_changed(self, num_actors: int) -> None:
        self.num_actors = num_actors
        self.add(self.run(self.core.set_rollout_actors(num_actors, self.now)))

    @rule(eta=st.integers(0, 3))
    def change_eta(self, eta: int) -> None:
        if eta < self.core.scheduling.eta:
            self.eta_lowered = True
        new = SchedulingConfig(**{**self.core.scheduling.__dict__, "eta": eta})
        self.add(self.run(self.core.update_scheduling(new, self.now)))

    @rule()
    def crash(self) -> None:
        self.resume()

    @precondition(lambda self: self.world.pending)
    @rule(index=st.integers(0, 1000), num_writes=st.integers(0, 6))
    def crash_mid_call(self, index: int, num_writes: int) -> None:
        order = self.world.take(index)
        completion = self.world.complete(order)
        self.world.delivered.append(completion)
        self.store.fail_after(num_writes)
        try:
            self.add(self.run(self.core.on_completion(completion, self.now)))
        except InjectedStoreFailure:
            self.resume()
        self.store.fail_after(None)

    # ------------------------------------------------------------------ invariants
    def durable(self) -> tuple[CursorRecord, dict[int, set[str]], dict[int, GroupOutcome]]:
        data = self.store.snapshot()
        cursor = CursorRecord.decode(data[CURSOR_KEY])
        live: dict[int, set[str]] = {}
        outcomes: dict[int, GroupOutcome] = {}
        for key, raw in data.items():
            if key.startswith(SLOT_PREFIX):
                slot = Slot.decode(raw)
                if slot.is_live:
                    live.setdefault(slot.position, set()).add(slot.state.value)
            elif key.startswith(OUTCOME_PREFIX):
                outcome = GroupOutcome.decode(raw)
                outcomes[outcome.position] = outcome
        return cursor, live, outcomes

    @invariant()
    def prompts_accounted_exactly_once(self) -> None:
        if self.core is None:
            return
        cursor, live, outcomes = self.durable()
        trained = {int(g.split("-p")[1]) for g in self.world.trainer.trained_groups}
        dropped = {p for p, o in outcomes.items() if o.dropped}
        assert not trained & dropped, f"prompts both trained and dropped: {trained & dropped}"
        for position in range(NUM_PROMPTS):
            in_table = position in live
            if (0, position) >= (cursor.epoch, cursor.position):
                assert not (in_table or position in trained or position in dropped), (position, cursor)
            elif position in trained:  # its slots may still say TRAIN until the TrainDone is applied
                assert not in_table or live[position] <= {"train"}, (position, live[position])
            elif position in dropped:
                assert not in_table, (position, live[position])
            else:
                assert in_table, f"prompt {position} admitted but neither live, trained nor dropped"

    def drain_to_completion(self) -> None:
        """Deliver everything (no more faults) until the dataset is done; then check the end state."""
        self.add(self.run(self.core.set_rollout_actors(max(self.num_actors, 1), self.now)))
        for _ in range(2000):
            if self.core.is_finished:
                break
            if self.world.pending:
                order = self.world.pending.pop(0)
                self.add(self.run(self.core.on_completion(self.world.complete(order), self.now)))
            else:
                self.now += TIMEOUT_S + 1
                self.add(self.run(self.core.tick(self.now)))
        assert self.core.is_finished, self.core.snapshot(self.now)
        _, live, outcomes = self.durable()
        assert not live
        trained = {int(g.split("-p")[1]) for g in self.world.trainer.trained_groups}
        dropped = {p for p, o in outcomes.items() if o.dropped}
        assert trained | dropped == set(range(NUM_PROMPTS)), (trained, dropped)
        assert all(o.reason for o in outcomes.values())
        if not self.eta_lowered:
            stale = [o for o in outcomes.values() if o.dropped and o.reason.startswith("stale")]
            assert not stale, stale


TestLifecycleProperties = LifecycleMachine.TestCase
TestLifecycleProperties.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


