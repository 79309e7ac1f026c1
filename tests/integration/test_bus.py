"""The bus on a real nats-server: listing keys while other clients write; a killed server restarted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest
from nats.js.errors import NoKeysError

from runtime.bus import Bus, Inbound, KVEntry, work_queue
from runtime.errors import BusError, BusTimeout, NoResponders, RevisionMismatch
from runtime.natsserver import NatsServer, NatsServerConfig
from tests.integration.harness import nats_bus


async def test_keys_lists_every_live_key_while_a_writer_updates_them(tmp_path: Path) -> None:
    """nats-py's own listing was short, empty or doubled in 43 of 300 tries of exactly this."""
    async with nats_bus(tmp_path) as bus:
        kv = await bus.kv("slots")
        with pytest.raises(NoKeysError):
            await kv.keys()
        for i in range(200):
            await kv.put(f"slot.{i}", b"x")
        for i in range(0, 200, 10):
            await kv.delete(f"slot.{i}")
        await kv.purge("slot.1")
        live = {f"slot.{i}" for i in range(200) if i % 10 and i != 1}

        stop = asyncio.Event()

        async def write() -> None:
            n = 0
            while not stop.is_set():
                i = n % 200
                if i % 10 and i != 1:
                    await kv.put(f"slot.{i}", b"y" * 100)
                n += 1

        writer = asyncio.create_task(write())
        try:
            listings = [await kv.keys() for _ in range(100)]
        finally:
            stop.set()
            await writer
        assert all(len(keys) == len(live) and set(keys) == live for keys in listings)
        assert set(await kv.keys(filters=["slot.2"])) == {k for k in live if "slot.2" in k}


async def test_a_second_client_sees_the_same_bucket(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        await (await bus.kv("config")).put("trainer.lr", b"1")
        other = await type(bus).connect(bus.nc.connected_url.geturl(), name="other")
        try:
            assert await (await other.kv("config")).keys() == ["trainer.lr"]
        finally:
            await other.close()


async def test_a_killed_server_is_restarted_and_clients_carry_on(tmp_path: Path) -> None:
    """kill -9 of the server: supervise() restarts it on its port and store; a pull consumer and a KV
    watch (renewed: the server lost its consumer) carry on; past max_restarts it gives up, saying so."""
    server = NatsServer(NatsServerConfig(store_dir=tmp_path / "nats", max_restarts=1, restart_window_s=60.0))
    url = await server.start()
    supervision = asyncio.ensure_future(server.supervise())
    bus = await Bus.connect(url, name="test")
    try:
        await bus.ensure_base()
        queue = work_queue("restart")
        await bus.ensure_queue(queue)
        kv = await bus.kv("config")
        watched: list[str | None] = []
        saw = {"before": asyncio.Event(), "after": asyncio.Event()}

        async def follow() -> None:
            async for entry in bus.kv_watch("config"):
                watched.append(entry.key if entry is not None else None)
                if watched[-1] in saw:
                    saw[watched[-1]].set()

        follower = asyncio.ensure_future(follow())
        await kv.put("before", b"1")
        await asyncio.wait_for(saw["before"].wait(), 10)  # the watch exists before the kill
        await bus.js.publish("work.restart", b"a")
        port, old_pid = server.port, server.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        async with asyncio.timeout(30):
            await bus.health.down.wait()
            await bus.health.up.wait()
        assert server.port == port and server.pid != old_pid and server.num_restarts == 1
        await kv.put("after", b"1")
        await bus.js.publish("work.restart", b"b")
        sub = await bus.js.pull_subscribe_bind(durable=queue.durable, stream=queue.stream)
        got = [m.data for m in await sub.fetch(batch=2, timeout=10)]
        assert got == [b"a", b"b"], "the stream kept its message across the kill and took the next"
        await asyncio.wait_for(saw["after"].wait(), 30)
        assert watched.count("before") == 2, watched  # replayed by the renewed watch
        follower.cancel()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)  # the second death within the window: past the limit
        with pytest.raises(BusError, match=r"died 2 times within 60s \(limit 1 restarts\)"):
            await asyncio.wait_for(supervision, 30)
    finally:
        supervision.cancel()
        await bus.close()
        await server.stop()


async def test_the_typed_kv_api_says_absent_and_conflict_in_the_runtimes_terms(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        assert await bus.kv_keys("config") == []
        assert await bus.kv_get("config", "a") is None
        first = await bus.kv_create("config", "a", b"1")
        with pytest.raises(RevisionMismatch):
            await bus.kv_create("config", "a", b"2")  # exists: the caller keeps what is there
        second = await bus.kv_cas("config", "a", b"2", first)
        with pytest.raises(RevisionMismatch):
            await bus.kv_cas("config", "a", b"3", first)  # changed since that revision was read
        assert await bus.kv_get("config", "a") == KVEntry("a", b"2", second)
        await bus.kv_put("config", "b", b"")
        assert sorted(await bus.kv_keys("config")) == ["a", "b"]
        await bus.kv_delete("config", "a")
        assert await bus.kv_get("config", "a") is None and await bus.kv_keys("config") == ["b"]
        await bus.kv_create("config", "a", b"again")  # a deleted key may be created anew
        seen: list[KVEntry | None] = []
        async with contextlib.aclosing(bus.kv_watch("config")) as entries:
            async for entry in entries:
                seen.append(entry)
                if entry is None:
                    await bus.kv_delete("config", "b")
                elif entry.deleted:
                    break
        assert [(e.key, e.value) if e else None for e in seen[:3]] == [("b", b""), ("a", b"again"), None]
        assert seen[-1] is not None and seen[-1].key == "b" and seen[-1].deleted


async def test_requests_say_who_is_not_there_and_who_is_too_slow(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        with pytest.raises(NoResponders):
            await bus.request("nobody.here", b"", timeout_s=2.0)

        async def echo(msg: Inbound) -> None:
            await bus.respond(msg, msg.subject.encode() + b":" + msg.data)

        async def silent(msg: Inbound) -> None:
            pass

        subs = [await bus.subscribe("echo.*", echo), await bus.subscribe("slow", silent)]
        try:
            assert await bus.request("echo.x", b"hi", timeout_s=2.0) == b"echo.x:hi"
            with pytest.raises(BusTimeout) as slow:
                await bus.request("slow", b"", timeout_s=0.3)
            assert isinstance(slow.value, TimeoutError) and isinstance(slow.value, BusError)
            await bus.flush(timeout_s=2.0)
        finally:
            for sub in subs:
                await sub.unsubscribe()
        await subs[0].unsubscribe()  # twice: quiet


async def test_a_work_queue_hands_out_typed_messages_and_follow_reads_a_stream(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        queue = work_queue("typed")
        await bus.ensure_queue(queue)
        consumer = await bus.pull_consumer(queue)
        assert await consumer.fetch(4, timeout_s=0.2) == []  # nothing there: empty, not an exception
        for _ in range(30):  # nats-py raises asyncio's TimeoutError when its deadline runs out between requests
            assert await consumer.fetch(4, timeout_s=0.001) == []
        await bus.publish_durable("work.typed", b"a", msg_id="m-a")
        await bus.publish_durable("work.typed", b"a", msg_id="m-a")  # deduplicated by its id
        (msg,) = await consumer.fetch(4, timeout_s=2.0)
        assert (msg.subject, msg.data, msg.num_delivered, msg.msg_id) == ("work.typed", b"a", 1, "m-a")
        await msg.nak(delay=0.0)
        (again,) = await consumer.fetch(4, timeout_s=5.0)
        assert again.num_delivered == 2 and again.stream_sequence == msg.stream_sequence
        await again.ack()
        states = {s.name: s for s in await bus.stream_states()}
        assert states[queue.stream].subjects == ("work.typed",)
        await consumer.unsubscribe()

        await bus.ensure_base()
        for i in range(3):
            await bus.publish_durable("log.test.info", str(i).encode())
        got = []
        async with contextlib.aclosing(bus.follow("log.>", "all")) as messages:
            async for m in messages:
                got.append((m.data, m.num_pending))
                if m.num_pending == 0:
                    break
        assert got == [(b"0", 2), (b"1", 1), (b"2", 0)]
        with pytest.raises(ValueError, match="start="):
            await anext(bus.follow("log.>", "everything"))  # type: ignore[arg-type]
