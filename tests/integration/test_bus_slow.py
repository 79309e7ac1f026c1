"""A bus that is connected but slow (its nats-server starved of CPU or disk, as beside other work on a loaded
host) does not end a follow or a KV watch: the server is stopped (SIGSTOP) for longer than a read's timeout
(5 s) but shorter than nats-py's ping-based disconnect (ping_interval_s * max_outstanding_pings = 30 s), so
the connection stays up while every read times out. The follow and the watch read again from where they stopped
and deliver everything exactly once, in order; past `BusLimits.max_slow_read_s` they fail, saying so."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from runtime.bus import Bus, BusLimits
from runtime.errors import BusTimeout
from runtime.natsserver import NatsServer, NatsServerConfig

pytestmark = pytest.mark.timeout(180)

_STORED = 300  # more than one batch of a follow's catch-up (256): it reads again while the server is stopped


@contextlib.asynccontextmanager
async def _bus(tmp_path: Path, limits: BusLimits) -> AsyncIterator[tuple[NatsServer, Bus]]:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test", limits=limits)
        try:
            await bus.ensure_base()
            yield server, bus
        finally:
            await bus.close()


@contextlib.contextmanager
def _stopped(server: NatsServer) -> Iterator[None]:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


async def test_a_follow_and_a_watch_go_on_across_a_server_stopped_for_longer_than_a_read(tmp_path: Path) -> None:
    """A follow stopped in the middle of its catch-up and a watch opened while the server is stopped for 12 s: each
    read that times out is a warning, and once the server answers again both deliver every message and record,
    those stored before and those after, once and in order, with no outage registered."""
    async with _bus(tmp_path, BusLimits()) as (server, bus):
        for i in range(_STORED):
            await bus.publish_durable("log.test.info", b"%d" % i)
        await bus.kv_put("config", "a", b"1")
        messages = aiter(bus.follow("log.>", "all"))
        watch = aiter(bus.kv_watch("config"))
        read = [await anext(messages)]  # the first batch is read: the next read comes while the server is stopped

        async def follow_to(n: int) -> None:
            while len(read) < n:
                read.append(await anext(messages))

        with structlog.testing.capture_logs() as events:
            with _stopped(server):
                reading = asyncio.create_task(follow_to(_STORED))
                watching = asyncio.create_task(anext(watch))
                await asyncio.sleep(12.0)
                for task in (reading, watching):
                    if task.done():
                        task.result()  # what ended it is the failure; nothing can be answered while stopped
                        pytest.fail("a read was answered while the server was stopped")
            async with asyncio.timeout(30):
                await reading
                first = await watching
                for i in range(_STORED, _STORED + 5):
                    await bus.publish_durable("log.test.info", b"%d" % i)
                await bus.kv_put("config", "b", b"2")
                await follow_to(_STORED + 5)
                watched = [first, await anext(watch), await anext(watch)]
        assert [m.data for m in read] == [b"%d" % i for i in range(_STORED + 5)]
        assert [m.stream_sequence for m in read] == list(range(1, _STORED + 6))
        assert [(e.key, e.value) if e else None for e in watched] == [("a", b"1"), None, ("b", b"2")]
        assert bus.health.num_outages == 0, "the connection stayed up: only slow"
        for kind in ("stream_follow_slow", "kv_watch_slow"):
            slow = [e for e in events if e["event"] == kind]
            assert slow and all(e["log_level"] == "warning" for e in slow), (kind, events)
            assert [e["num_timeouts"] for e in slow] == list(range(1, len(slow) + 1)), slow  # one row of timeouts
        await messages.aclose()
        await watch.aclose()


async def test_a_follow_and_a_watch_fail_saying_so_once_the_server_is_slow_for_longer_than_the_bound(
    tmp_path: Path,
) -> None:
    """With `BusLimits.max_slow_read_s` at 8 s, a stop that outlasts it (still short of the ping-based disconnect)
    ends both with a `BusTimeout` that says how long and what to check."""
    async with _bus(tmp_path, BusLimits(max_slow_read_s=8.0)) as (server, bus):
        await bus.publish_durable("log.test.info", b"0")
        await bus.kv_put("config", "a", b"1")
        messages = aiter(bus.follow("log.>", "all"))
        watch = aiter(bus.kv_watch("config"))
        with _stopped(server):
            began = time.monotonic()
            async with asyncio.timeout(28):
                results = await asyncio.gather(anext(messages), anext(watch), return_exceptions=True)
            failed_after_s = time.monotonic() - began
        for error in results:
            assert isinstance(error, BusTimeout), results
            assert "max_slow_read_s=8" in str(error) and "starved" in str(error), error
        assert failed_after_s > 8.0, failed_after_s
        assert bus.health.num_outages == 0
