"""Bus.kv_watch without a consumer (runtime.kv_watch): as an actor role on a real nats-server with the default
run's users, the current records, then every put, delete, purge and expiry in order; nothing lost or repeated
when writes race the snapshot; a change lost on the way noticed and the bucket read again."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from runtime.bus import Bus, KVEntry
from tests.integration.bus_clients import bus_as, default_run_bus, lose_first_message

pytestmark = pytest.mark.timeout(180)


def _shown(entry: KVEntry | None) -> tuple[str, bytes, str] | None:
    if entry is None:
        return None
    return entry.key, entry.value, "purged" if entry.purged else "deleted" if entry.deleted else "put"


async def test_a_watch_sees_the_current_records_then_each_change_in_order_and_makes_no_consumer(
        tmp_path: Path) -> None:
    """The reconciler role watches the registry (``actors``, a lease bucket): the current records (a deleted key's
    marker included) in stream order, then None, then a put, a delete, a purge and a lease that ran out (the
    server's marker), in the order they were stored; the bucket's stream has no consumer meanwhile (the role
    makes none on KV_actors)."""
    async with default_run_bus(tmp_path) as (admin, info), bus_as(info, "reconciler") as reconciler:
        await admin.kv_put("actors", "reg.rollout.a", b"1", ttl_s=60)
        await admin.kv_put("actors", "reg.rollout.b", b"2", ttl_s=60)
        await admin.kv_put("actors", "handover.rollout", b"h")
        await admin.kv_delete("actors", "handover.rollout")
        seen: list[KVEntry | None] = []
        async with asyncio.timeout(30), contextlib.aclosing(reconciler.kv_watch("actors")) as entries:
            async for entry in entries:
                seen.append(entry)
                if entry is None:
                    assert await admin.js.consumers_info("KV_actors") == []
                    await admin.kv_put("actors", "reg.rollout.a", b"3", ttl_s=60)
                    await admin.kv_delete("actors", "reg.rollout.b")
                    await admin.kv_put("actors", "reg.rollout.c", b"4", ttl_s=1)  # not renewed: the server removes it
                    await (await admin.kv("actors")).purge("reg.rollout.a")
                elif entry.key == "reg.rollout.c" and entry.deleted:
                    break
        assert [_shown(e) for e in seen] == [("reg.rollout.a", b"1", "put"), ("reg.rollout.b", b"2", "put"),
                        ("handover.rollout", b"", "deleted"), None,
                        ("reg.rollout.a", b"3", "put"), ("reg.rollout.b", b"", "deleted"),
                        ("reg.rollout.c", b"4", "put"), ("reg.rollout.a", b"", "purged"),
                        ("reg.rollout.c", b"", "purged")]  # the lease that ran out (nats-server's MaxAge marker)
        assert await admin.js.consumers_info("KV_actors") == []


async def _watch_until(bus: Bus, bucket: str, last_key: str, into: list[KVEntry | None],
                       caught_up: Callable[[], None]) -> None:
    async with contextlib.aclosing(bus.kv_watch(bucket)) as entries:
        async for entry in entries:
            into.append(entry)
            if entry is None:
                caught_up()
            if entry is not None and entry.key == last_key:
                return


async def test_no_change_is_lost_or_repeated_when_writes_race_the_snapshot(tmp_path: Path) -> None:
    """One writer puts and deletes 40 keys of ``config`` 600 times back to back; 12 watches of the
    evaluator role start one after another while it writes (each after the next 50 writes). Each watch shows
    every key's records from the one its snapshot held on, each once and in order (no loss, no repeat), and
    ends in the bucket's final state, without starting again and without a consumer; and writes were made
    while watches subscribed and read (the race). No watch is a consumer on KV_config."""
    rng = random.Random(7)
    async with default_run_bus(tmp_path) as (admin, info), bus_as(info, "evaluator") as evaluator:
        history: dict[str, list[tuple[int, bytes, bool]]] = {}  # key -> (revision, value, deleted), as written
        started = [asyncio.Event() for _ in range(12)]
        watched: list[list[KVEntry | None]] = [[] for _ in started]
        consumers: list[int] = []
        written = [0]  # writes made so far
        raced: list[tuple[int, int]] = []  # per watch: writes made when it started, when its snapshot was in

        async def write() -> None:
            for n in range(600):
                key = f"k.{rng.randrange(40)}"
                if rng.random() < 0.2 and history.get(key) and not history[key][-1][2]:
                    await admin.kv_delete("config", key)
                    revision = (await admin.js.stream_info("KV_config")).state.last_seq  # the only writer
                    history[key].append((revision, b"", True))
                else:
                    value = f"{n}".encode()
                    history.setdefault(key, []).append((await admin.kv_put("config", key, value), value, False))
                written[0] = n + 1
                if n % 50 == 0:
                    started[n // 50].set()  # it subscribes and reads while the next writes go on
                if n == 300:
                    consumers.append(len(await admin.js.consumers_info("KV_config")))
            history["end"] = [(await admin.kv_put("config", "end", b"."), b".", False)]

        async def watch(i: int) -> None:
            await started[i].wait()
            at_start = written[0]
            await _watch_until(evaluator, "config", "end", watched[i], lambda: raced.append((at_start, written[0])))

        with structlog.testing.capture_logs() as events:
            async with asyncio.timeout(120), asyncio.TaskGroup() as tg:
                tg.create_task(write())
                for i in range(len(started)):
                    tg.create_task(watch(i))
        assert consumers == [0]
        assert any(b > a for a, b in raced), f"no write while a watch subscribed and read: no race ({raced})"
        assert not [e for e in events if e["event"] in ("kv_watch_gap", "kv_watch_renewed")], events
        final = {k: h[-1][1] for k, h in history.items() if not h[-1][2]}
        for i, entries in enumerate(watched):
            assert entries.count(None) == 1, i
            by_key: dict[str, list[tuple[int, bytes, bool]]] = {}
            for entry in entries:
                if entry is not None:
                    by_key.setdefault(entry.key, []).append((entry.revision, entry.value, entry.deleted))
            state = {}
            for key, records in by_key.items():
                written = history[key]
                first = [r for r, _, _ in written].index(records[0][0])
                assert records == written[first:], (i, key)  # from its snapshot's record on: each once, in order
                if not records[-1][2]:
                    state[key] = records[-1][1]
            assert state == final, i
            assert set(history) - set(by_key) <= {k for k, h in history.items() if h[-1][2]}, i  # only deleted unseen


async def test_a_change_lost_on_the_way_is_noticed_and_the_bucket_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reconciler role's watch of ``config`` loses the record of a put (its subscription drops it): the
    next record the stream republishes (another key's) is not the next sequence, the watch says
    ``kv_watch_gap``, reads the bucket again (its current records, then None) and goes on."""
    async with default_run_bus(tmp_path) as (admin, info), bus_as(info, "reconciler") as reconciler:
        await admin.kv_put("config", "a", b"0")
        dropping = lose_first_message(monkeypatch, reconciler, "kvwatch.", "kvwatch.config.a")
        seen: list[tuple[str, bytes, bool] | None] = []
        with structlog.testing.capture_logs() as events:
            async with asyncio.timeout(30), contextlib.aclosing(reconciler.kv_watch("config")) as entries:
                async for entry in entries:
                    seen.append(None if entry is None else (entry.key, entry.value, entry.deleted))
                    if seen == [("a", b"0", False), None]:
                        await admin.kv_put("config", "a", b"1")  # lost on the way
                        await admin.kv_put("config", "b", b"1")  # not the next sequence: a gap
                        await admin.kv_put("config", "a", b"2")
                        await admin.kv_put("config", "c", b"1")
                    elif entry is not None and entry.key == "c":
                        break
        assert dropping, "the watch did not subscribe to the bucket's republished records"
        assert dropping[0].dropped == 1
        # the four writes are made before the watch goes on: b's record shows the gap, and the bucket read again
        # holds b, a (its latest) and c
        assert seen == [("a", b"0", False), None, ("b", b"1", False), ("a", b"2", False), ("c", b"1", False)], seen
        gaps = [e for e in events if e["event"] == "kv_watch_gap"]
        assert [(g["subject"], g["sequence"], g["expected"]) for g in gaps] == [("$KV.config.b", 3, 2)], gaps
