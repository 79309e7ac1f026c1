"""What the reconciler and the registry's readers do per event, counted: nothing grows with the table or
the number of actors where one event (a resume's read, a lease renewal, a scrape) needs only a bounded part."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from actors import Lifecycle, LifecycleConfig, ListTaskSource, SchedulingConfig, TrainOrder
from actors.reconciler.registry_view import RegistryView
from actors.testing import InMemorySlotStore
from ops import status as ops_status
from ops.dashboard import prometheus
from runtime.kv_watch import KVEntry
from runtime.registry import registration_key
from tests.bench.lifecycle_core import completion_for


async def test_a_resume_reads_the_table_in_one_bulk_read_not_a_request_per_slot() -> None:
    store = InMemorySlotStore()
    config = LifecycleConfig(num_slots=1024, group_size=4, batch_size_groups=8,
                             scheduling=SchedulingConfig(max_inflight_per_rollout_actor=1024))
    source = ListTaskSource.numbered(100)
    first = await Lifecycle.resume(store, source, config, 0.0, num_rollout_actors=1)
    assert first.orders  # the table holds work in flight
    reads = store.num_reads
    again = await Lifecycle.resume(store, source, config, 1.0, num_rollout_actors=1)
    assert again.lifecycle.slots == first.lifecycle.slots
    assert store.num_reads - reads <= 4, f"{store.num_reads - reads} reads of single keys for a table of 1024 slots"


class _CountingDict(dict):
    """The registry view's members, counting every walk over them."""

    walks = 0

    def values(self) -> Any:
        type(self).walks += 1
        return super().values()

    def items(self) -> Any:
        type(self).walks += 1
        return super().items()

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()


def _entry(kind: str, state: str = "running") -> bytes:
    return msgpack.packb({"kind": kind, "state": state, "lease_s": 10.0})


def test_a_lease_renewal_and_the_running_count_do_not_walk_every_actor() -> None:
    view = RegistryView()
    for i in range(1000):
        view.observe(f"rollout-{i}", _entry("rollout"), now=0.0)
    view.observe("trainer-0", _entry("trainer"), now=0.0)
    view._members = _CountingDict(view._members)  # the walks over it are what is counted
    _CountingDict.walks = 0
    view.observe("rollout-7", _entry("rollout"), now=1.0)  # a renewal, as the reconciler's watch sees it
    view.observe("rollout-8", _entry("rollout", "draining"), now=1.0)
    view.observe("rollout-9", None, now=1.0)  # removed while running: lost
    assert view.num_running("rollout") == 998 and view.num_running("trainer") == 1
    assert _CountingDict.walks == 0
    # the count kept follows losses, returns and clean stops as the walk did
    view = RegistryView()
    view.observe("rollout-1", _entry("rollout"), now=0.0)
    view.observe("rollout-2", _entry("rollout"), now=5.0)
    assert [x.actor_id for x in view.expire(now=11.0)] == ["rollout-1"]
    assert view.num_running("rollout") == 1
    view.observe("rollout-1", _entry("rollout"), now=12.0)  # renewed after a pause: alive again
    assert view.num_running("rollout") == 2
    view.observe("rollout-2", _entry("rollout", "stopped"), now=13.0)
    view.observe("rollout-2", None, now=14.0)
    assert view.num_running("rollout") == 1


class _Registry:
    """The ``actors`` bucket as `ops.status.registered` reads it, counting the requests."""

    def __init__(self, num: int) -> None:
        self.entries = {}
        for i in range(num):
            actor_id = f"rollout-{i}-ab"
            self.entries[registration_key("rollout", actor_id)] = msgpack.packb({
                "kind": "rollout", "id": actor_id, "pid": 1, "host": "h", "code_hash": "c", "state": "running",
                "num_inflight": 0, "num_handled": 0, "num_failed": 0, "num_dead_lettered": 0, "uptime_s": 1.0})
        self.requests = 0

    async def kv_keys(self, bucket: str) -> list[str]:
        self.requests += 1
        return list(self.entries)

    async def kv_get(self, bucket: str, key: str) -> KVEntry:
        self.requests += 1
        return KVEntry(key, self.entries[key], 1)

    async def kv_items(self, bucket: str, keys: str = ">") -> list[KVEntry]:
        self.requests += 1
        return [KVEntry(k, v, 1) for k, v in self.entries.items()]


async def test_the_registry_is_listed_in_a_bounded_number_of_requests() -> None:
    bus = _Registry(300)
    actors, malformed = await ops_status.registered(bus)  # type: ignore[arg-type]
    assert len(actors) == 300 and not malformed
    assert bus.requests <= 2


async def test_a_scrape_asks_a_bounded_number_of_actors_at_once(monkeypatch: Any) -> None:
    bus = _Registry(500)
    in_flight = peak = 0

    async def metrics(_bus: Any, kind: str, actor_id: str, timeout_s: float) -> str:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        return "# TYPE asyncrl_actor_inflight gauge\nasyncrl_actor_inflight 1.0\n"

    monkeypatch.setattr(prometheus, "_actor_metrics", metrics)
    text = (await prometheus.scrape(bus, "run", "name")).decode()  # type: ignore[arg-type]
    assert text.count("asyncrl_scrape_up{") == 500 and text.count("asyncrl_actor_inflight{") == 500
    assert 1 < peak <= prometheus.MAX_REQUESTS_IN_FLIGHT < 500


def _full_table(num_slots: int = 1200) -> tuple[InMemorySlotStore, LifecycleConfig, ListTaskSource]:
    # eta 2: three batches fill the table
    config = LifecycleConfig(num_slots=num_slots, group_size=4, batch_size_groups=num_slots // 12,
                             scheduling=SchedulingConfig(max_inflight_per_rollout_actor=num_slots))
    return InMemorySlotStore(), config, ListTaskSource.numbered(num_slots)


async def test_a_tick_reads_neither_every_group_nor_every_unit_of_work(monkeypatch: Any) -> None:
    store, config, source = _full_table()
    core = (await Lifecycle.resume(store, source, config, 0.0, num_rollout_actors=1)).lifecycle
    assert core.snapshot(0.0).slots_per_state["rollout"] == 1200  # every slot in flight
    await core.tick(1.0)  # the first tick may look at every group (nothing was checked yet)
    deadlines = timeouts = 0
    flow_type = type(core._flow)  # its calls per group are what is counted
    deadline = flow_type.deadline

    def counted_deadline(self: Any, group: Any) -> int:
        nonlocal deadlines
        deadlines += 1
        return deadline(self, group)

    def counted_timeout(self: Any, stage: Any) -> float:
        nonlocal timeouts
        timeouts += 1
        return getattr(self.scheduling, f"{stage.value}_timeout_s")

    monkeypatch.setattr(flow_type, "deadline", counted_deadline)
    monkeypatch.setattr(flow_type, "timeout_s", counted_timeout)
    for now in (2.0, 3.0, 4.0):
        assert await core.tick(now) == []
    assert deadlines == 0, f"{deadlines} group deadlines computed by 3 ticks of a table of 300 groups"
    assert timeouts <= 3 * 8, f"{timeouts} units of work read by 3 ticks of a table of 1200 in flight"
    retried = await core.tick(200.0)  # past the rollout timeout: every rollout is retried, none missed
    assert len(retried) == 1200 and deadlines == 0


async def test_the_groups_that_left_the_table_are_said_by_the_core() -> None:
    store, config, source = _full_table(96)
    resumed = await Lifecycle.resume(store, source, config, 0.0, num_rollout_actors=1)
    core, pending, version = resumed.lifecycle, list(resumed.orders), 0
    trained: list[str] = []
    while pending and not trained:
        order = pending.pop(0)
        if isinstance(order, TrainOrder):
            version = order.trainer_version + 1
            trained = list(order.group_ids)
        pending += await core.on_completion(completion_for(order, version), 1.0)
    assert sorted(core.take_left_groups()) == sorted(trained) and len(trained) == 8
    assert core.take_left_groups() == []
    live = {s.group_id for s in core.slots if s.is_live}
    assert live and all(core.is_live_group(g) for g in live) and not any(core.is_live_group(g) for g in trained)
