"""Broad catches that hid outages: each of these turned a bus failure into a plausible answer
("no handover", "no rollout actor", "key already set", "recorded") or a traceback. On a real
nats-server: an outage is raised, a real absence is an answer, a bad record is named."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from actors.reconciler.actor import ReconcilerActor
from actors.reconciler.lifecycle import CoreBroken
from actors.reconciler.registry_view import RegistryView
from ops import status as ops_status
from runtime.actor import Actor, ActorContext, ActorIdentity, ActorSettings
from runtime.bus import Bus
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.registry import registration_key
from runtime.run_config import load_run_config
from runtime.run_state import RECORD_KEY, RUN_BUCKET, RunRecord
from runtime.rundir import RunInfo
from runtime.up import _publish_live_defaults
from tests.integration.harness import nats_bus

pytestmark = pytest.mark.timeout(120)


async def _a_run_on(server: NatsServer, run_dir: Path) -> None:
    """What ``runtime.up`` leaves for the ops commands: the run's record on its bus, then its run.json."""
    info = RunInfo(str(run_dir), server.url, "", "", os.getpid(), time.time())
    bus = await Bus.connect(server.url, name="test")
    try:
        await bus.ensure_base()
        await bus.kv_create(RUN_BUCKET, RECORD_KEY, RunRecord(info.run, "test", "", "", time.time()).to_bytes())
    finally:
        await bus.close()
    info.write()


def _actor(bus: Bus, kind: str = "counter") -> Actor:
    return Actor(ActorContext(ActorIdentity.here(kind, f"{kind}-1", "h"), bus, ActorSettings(), None))


async def _closed(bus: Bus) -> Bus:
    for bucket in ("actors", "config"):
        await bus.kv(bucket)  # cached: what fails below is the read itself, not the lookup
    await bus.nc.close()
    return bus


async def test_take_handover_tells_nothing_left_from_an_unreadable_bus(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        actor = _actor(bus)
        assert await actor.take_handover() is None  # nothing handed over: a real answer
        await (await bus.kv("actors")).put("handover.counter", msgpack.packb({"n": 3}))
        assert await actor.take_handover() == {"n": 3}
        assert await actor.take_handover() is None  # consumed once
        await _closed(bus)
        with pytest.raises(Exception) as err:
            await actor.take_handover()
        assert not isinstance(err.value, KeyError), "an outage is not 'nothing handed over'"


async def test_a_resumed_run_keeps_live_values_and_does_not_hide_an_outage(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('[actors.counter]\nentry = "tests.integration.workers:CounterActor"\n')
    cfg = load_run_config([tmp_path / "run.toml"])
    async with nats_bus(tmp_path) as bus:
        kv = await bus.kv("config")
        await kv.put("counter.delay_scale", msgpack.packb(3.0))  # an operator's change before the stop
        await _publish_live_defaults(bus, cfg, resumed=True)
        assert msgpack.unpackb((await kv.get("counter.delay_scale")).value) == 3.0
        await _closed(bus)
        with pytest.raises(Exception) as err:
            await _publish_live_defaults(bus, cfg, resumed=True)
        assert "WrongLastSequence" not in type(err.value).__name__


def _registration(kind: str, actor_id: str) -> dict[str, Any]:
    """A complete registry entry, as `Actor.describe` writes it (runtime.registry refuses less)."""
    return {"kind": kind, "id": actor_id, "pid": 1, "host": "h", "code_hash": "h", "state": "running",
            "num_inflight": 0, "num_handled": 0, "num_failed": 0, "num_dead_lettered": 0, "uptime_s": 1.0,
            "lease_s": 10.0}


async def test_reconciler_counts_no_rollout_actor_only_when_there_is_none(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        reconciler = ReconcilerActor.__new__(ReconcilerActor)
        reconciler.bus, reconciler.num_rejected_registrations, reconciler.registry = bus, 0, RegistryView()
        assert await reconciler._count_rollout_actors() == 0
        kv = await bus.kv("actors")
        await kv.put(registration_key("rollout", "rollout-1"), msgpack.packb(_registration("rollout", "rollout-1")))
        await kv.put(registration_key("reward", "reward-1"), msgpack.packb(_registration("reward", "reward-1")))
        await kv.put("rollout-2", msgpack.packb(_registration("rollout", "rollout-2")))  # not under its own key
        assert await reconciler._count_rollout_actors() == 1
        await _closed(bus)
        with pytest.raises(Exception):  # noqa: B017 - whatever the client raises, not a count of 0
            await reconciler._count_rollout_actors()


async def test_reconciler_naks_a_completion_its_broken_core_did_not_record() -> None:
    class BrokenCore:
        async def on_completion(self, *args: Any) -> list:
            raise CoreBroken("an earlier write failed")

    reconciler = ReconcilerActor.__new__(ReconcilerActor)
    resumed: list[bool] = []

    async def resume() -> None:
        resumed.append(True)

    reconciler.core_lock, reconciler.core, reconciler.store = asyncio.Lock(), BrokenCore(), None
    reconciler._resume = resume  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="nak"):  # the base naks what handle raises: redelivered
        await reconciler.handle(object(), None)  # type: ignore[arg-type]
    assert resumed == [True]


async def test_status_reports_a_malformed_registry_entry_beside_the_others(tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        await _a_run_on(server, tmp_path)
        bus = await Bus.connect(server.url, name="test")
        try:
            kv = await bus.kv("actors")
            await kv.put(registration_key("counter", "counter-1"), msgpack.packb(_registration("counter", "counter-1")))
            await kv.put("counter-2", msgpack.packb(_registration("counter", "counter-2")))  # the old key: refused
            await kv.put("garbage", b"\xc1\xc1")
            await kv.put("a-list", msgpack.packb([1, 2]))
            await kv.put("half", msgpack.packb({"kind": "counter", "id": 5}))
            await kv.put("handover.counter", msgpack.packb({"n": 1}))
        finally:
            await bus.close()
        status = await ops_status.collect(tmp_path)
        assert [a["id"] for a in status["actors"]] == ["counter-1"]
        assert sorted(m["key"] for m in status["malformed_entries"]) == ["a-list", "counter-2", "garbage", "half"]
        text = ops_status.render(status)
        assert "malformed registry entry 'garbage' is not msgpack" in text and "counter-1" in text


async def test_a_handling_failed_by_a_bus_outage_is_not_the_messages_fault(tmp_path: Path) -> None:
    """With max_deliveries=1 a failed handling is a dead letter at once, unless the bus dropped while it
    ran (then it is nak'ed: an outage must not dead-letter good work)."""
    from runtime.bus import work_queue

    async with nats_bus(tmp_path) as bus:
        queue = work_queue("outage")
        await bus.ensure_queue(queue)
        actor = Actor(ActorContext(ActorIdentity.here("x", "x-1", "h"), bus, ActorSettings(max_deliveries=1), None))
        sub = await bus.pull_consumer(queue)
        await bus.publish_durable("work.outage", b"m1")
        (raw,) = await sub.fetch(1, timeout_s=5)
        outages_before = bus.health.num_outages - 1  # the bus dropped (and came back) while it was handled
        await actor._failed(queue, raw, "T", ConnectionError("publish timed out"), outages_before)
        assert actor.num_dead_lettered == 0
        (again,) = await sub.fetch(1, timeout_s=10)  # nak'ed: redelivered
        assert again.data == b"m1" and again.num_delivered == 2
        await actor._failed(queue, again, "T", ValueError("bad"), bus.health.num_outages)
        assert actor.num_dead_lettered == 1
        dlq = await bus.js.subscribe("dlq.>", ordered_consumer=True, deliver_policy=None)
        letter = await dlq.next_msg(timeout=5)
        assert letter.headers["Reason"] == "max_deliveries" and "ValueError('bad')" in letter.headers["Detail"]


async def test_config_list_shows_a_malformed_value_beside_the_others(tmp_path: Path) -> None:
    from ops import config as ops_config

    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        await _a_run_on(server, tmp_path)
        assert await ops_config._items(tmp_path) == {}  # nothing set: an empty listing, not NoKeysError
        bus = await Bus.connect(server.url, name="test")
        try:
            kv = await bus.kv("config")
            await kv.put("counter.delay_scale", msgpack.packb(2.0))
            await kv.put("counter.broken", b"\xc1")
        finally:
            await bus.close()
        items = await ops_config._items(tmp_path)
        assert items["counter.delay_scale"] == 2.0
        assert repr(items["counter.broken"]).startswith("<malformed: not msgpack")
