"""Bus.follow without a consumer: as the dashboard role (an actor kind of the default run) on a real nats-server
with the default run's users, the event log from everything kept, from new ones, or from a time, then live;
nothing lost or repeated when writes race the catch-up; a message lost on the way noticed and read again."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog

from runtime.bus import Bus, StreamMessage
from tests.integration.bus_clients import bus_as, default_run_bus, lose_first_message

pytestmark = pytest.mark.timeout(180)


async def _read(bus: Bus, start: Any, last: bytes, into: list[StreamMessage],
                caught_up: asyncio.Event | None = None) -> None:
    """Follows the log from ``start`` into ``into`` until the message ``last``; ``caught_up`` is set at the first
    message read with none left after it, or at the first one when the follow reads live."""
    async with contextlib.aclosing(bus.follow("log.>", start)) as messages:
        async for msg in messages:
            into.append(msg)
            if caught_up is not None and msg.num_pending == 0:
                caught_up.set()
            if msg.data == last:
                return


async def test_a_follow_reads_the_log_from_a_point_then_live_without_a_consumer(tmp_path: Path) -> None:
    """Five stored events, then a follow from "all" (each with how many are left) and from a time between the
    third and the fourth; five more events once both read the stored ones: each gets its part once and in
    order, the live ones too. A follow from "new" gets only what was stored after it began. LOG has no
    consumer meanwhile."""
    async with default_run_bus(tmp_path) as (admin, info), bus_as(info, "dashboard") as dashboard:
        for i in range(5):
            await admin.publish_durable(f"log.rollout.{'info' if i % 2 else 'error'}", b"%d" % i)
            if i == 2:  # after the third was stored (acknowledged), before the fourth is sent: one machine's clock
                between = datetime.now(UTC)
        reads: dict[str, list[StreamMessage]] = {"all": [], "time": [], "new": []}
        caught_up = {name: asyncio.Event() for name in reads}
        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
            for name, start in (("all", "all"), ("time", between)):
                tg.create_task(_read(dashboard, start, b"9", reads[name], caught_up[name]))
            await caught_up["all"].wait()
            await caught_up["time"].wait()
            assert await admin.js.consumers_info("LOG") == []
            for i in range(5, 10):
                await admin.publish_durable("log.trainer.info", b"%d" % i)
        assert [(m.data, m.num_pending) for m in reads["all"][:5]] == [(b"%d" % i, 4 - i) for i in range(5)]
        assert [m.data for m in reads["all"]] == [b"%d" % i for i in range(10)]
        assert [m.subject for m in reads["all"][:2]] == ["log.rollout.error", "log.rollout.info"]
        assert [m.stream_sequence for m in reads["all"]] == list(range(1, 11))
        assert [m.data for m in reads["time"]] == [b"%d" % i for i in range(3, 10)]

        async def write_until_read() -> None:  # each a round trip to the stream; until the new follow has one
            n = 10
            while not caught_up["new"].is_set():
                await admin.publish_durable("log.trainer.info", b"%d" % n)
                n += 1
            await admin.publish_durable("log.trainer.info", b"end")

        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
            tg.create_task(_read(dashboard, "new", b"end", reads["new"], caught_up["new"]))
            tg.create_task(write_until_read())
        numbers = [int(m.data) for m in reads["new"][:-1]]
        assert numbers and numbers[0] >= 10 and numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        assert reads["new"][-1].data == b"end"
        assert await admin.js.consumers_info("LOG") == []


async def test_no_message_is_lost_or_repeated_when_writes_race_the_catch_up(tmp_path: Path) -> None:
    """One writer puts 400 events into the log back to back; 8 follows from "all" start one after another while
    it writes (each after the next 50): each gets every event once, in order, without reading again, and
    without a consumer on LOG."""
    async with default_run_bus(tmp_path) as (admin, info), bus_as(info, "dashboard") as dashboard:
        started = [asyncio.Event() for _ in range(8)]
        reads: list[list[StreamMessage]] = [[] for _ in started]

        async def write() -> None:
            for n in range(400):
                await admin.publish_durable(f"log.k{n % 7}.info", b"%d" % n)
                if n % 50 == 0:
                    started[n // 50].set()
            await admin.publish_durable("log.end.info", b"end")

        async def follow(i: int) -> None:
            await started[i].wait()
            await _read(dashboard, "all", b"end", reads[i])

        with structlog.testing.capture_logs() as events:
            async with asyncio.timeout(120), asyncio.TaskGroup() as tg:
                tg.create_task(write())
                for i in range(len(started)):
                    tg.create_task(follow(i))
        assert not [e for e in events if e["event"] in ("stream_follow_gap", "stream_follow_renewed")], events
        for i, read in enumerate(reads):
            assert [m.data for m in read] == [b"%d" % n for n in range(400)] + [b"end"], i
        assert await admin.js.consumers_info("LOG") == []


async def test_a_message_lost_on_the_way_is_noticed_and_read_again_from_the_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live follow loses one republished event (its subscription drops it): the next one it receives is not
    the next sequence, the follow says ``stream_follow_gap`` and reads the stream again from the message after
    the last it delivered: every event once, in order."""
    async with default_run_bus(tmp_path) as (admin, info), bus_as(info, "dashboard") as dashboard:
        dropping = lose_first_message(monkeypatch, dashboard, "follow.", "follow.log.a.info")
        await admin.publish_durable("log.a.info", b"0")
        read: list[StreamMessage] = []
        with structlog.testing.capture_logs() as events:
            async with asyncio.timeout(30), contextlib.aclosing(dashboard.follow("log.>", "all")) as messages:
                async for msg in messages:
                    read.append(msg)
                    if msg.data == b"0":
                        for subject, data in (("log.a.info", b"1"), ("log.b.info", b"2"), ("log.a.info", b"3")):
                            await admin.publish_durable(subject, data)  # 1 lost: 2 is not the next sequence
                    elif msg.data == b"3":
                        break
        assert dropping, "the follow did not subscribe to the stream's republished messages"
        assert dropping[0].dropped == 1
        assert [(m.data, m.stream_sequence) for m in read] == [(b"0", 1), (b"1", 2), (b"2", 3), (b"3", 4)]
        gaps = [e for e in events if e["event"] == "stream_follow_gap"]
        assert [(g["subject"], g["sequence"], g["expected"]) for g in gaps] == [("log.b.info", 3, 2)], gaps
