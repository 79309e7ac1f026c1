"""A bulk read of a bucket of more keys than one direct get reads (`Bus.kv_items`, `Bucket.current`, a
reconciler's resume) on a real nats-server: several batches in flight at once, all read at one stream
sequence, delete and purge markers seen, and a failing batch failing the read without leaving a
subscription behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import runtime.bus
from runtime.bus import Bus, BusClient, ChainedKVWriter
from runtime.errors import BusError
from tests.integration.harness import nats_bus

pytestmark = pytest.mark.timeout(120)

NUM_KEYS = 5000  # five direct gets of at most 1024 keys


def _value(i: int, version: int = 0) -> bytes:
    return f"{i}:{version}".encode() * 4


async def _filled(bus: Bus, bucket: str = "slots") -> None:
    writer = await ChainedKVWriter.open(bus, bucket, ack_timeout_s=60.0)
    try:
        for i in range(NUM_KEYS):
            writer.write(f"k.{i:05d}", _value(i), None)
        await writer.flush()
    finally:
        await writer.close()


def _counting_gets(monkeypatch: pytest.MonkeyPatch, before_get: Any = None) -> dict[str, int]:
    """Wraps the bus's direct gets (the real ones still run): how many were in flight at most, and in all."""
    seen = {"in_flight": 0, "most_in_flight": 0, "num": 0}
    real = runtime.bus.direct_get

    async def counted(*args: Any, **kwargs: Any) -> Any:
        seen["num"] += 1
        seen["in_flight"] += 1
        seen["most_in_flight"] = max(seen["most_in_flight"], seen["in_flight"])
        try:
            if before_get is not None:
                await before_get(seen["num"])
            return await real(*args, **kwargs)
        finally:
            seen["in_flight"] -= 1

    monkeypatch.setattr(runtime.bus, "direct_get", counted)
    return seen


async def test_a_large_bucket_is_read_whole_in_batches_in_flight_together_with_its_markers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 keys (the server reads at most 1,024 a request), some deleted, some purged: `kv_items` gives every
    live key's last value in stream order and `Bucket.current` the markers too; the batches are read several
    at once (a resume of 10^5 slots read them one after another, the server and this process each idle half
    the time), never more than the bound."""
    async with nats_bus(tmp_path) as bus:
        await _filled(bus)
        for i in range(0, NUM_KEYS, 7):
            await bus.kv_put("slots", f"k.{i:05d}", _value(i, 1))
        for i in range(3, NUM_KEYS, 11):
            await bus.kv_delete("slots", f"k.{i:05d}")
        kv = await bus.kv("slots")
        for i in range(5, NUM_KEYS, 13):
            await kv.purge(f"k.{i:05d}")
        seen = _counting_gets(monkeypatch)
        assert isinstance(bus.nc, BusClient)  # nats-py's client, with the cheaper header parse

        items = await bus.kv_items("slots", "k.>")
        _, current = await kv.current("k.>")

    gone = {i for i in range(3, NUM_KEYS, 11)} | {i for i in range(5, NUM_KEYS, 13)}
    assert {e.key: e.value for e in items} == {
        f"k.{i:05d}": _value(i, 1 if i % 7 == 0 else 0) for i in range(NUM_KEYS) if i not in gone}
    assert [e.revision for e in items] == sorted(e.revision for e in items)  # stream order
    assert {e.key for e in current if e.deleted} == {f"k.{i:05d}" for i in gone}
    assert {e.key for e in current if e.purged} == {f"k.{i:05d}" for i in range(5, NUM_KEYS, 13)}
    assert 1 < seen["most_in_flight"] <= runtime.bus._READS_IN_FLIGHT


async def test_a_write_landing_while_the_batches_are_read_is_in_none_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes made while the batches are in flight (to keys of every batch, a new key, a delete) show in no
    batch: every batch reads at the sequence the listing saw, nothing after it, and a watch going on from
    the read's cursor gets them all. (A key rewritten meanwhile is missing from the read: the bucket keeps
    one record per key, so its record at that sequence is gone; a watch gets its new record after the cursor.)"""
    async with nats_bus(tmp_path) as bus:
        await _filled(bus)
        kv = await bus.kv("slots")
        written = asyncio.Event()
        rewritten = {f"k.{i:05d}" for i in range(0, NUM_KEYS, 500)} | {"k.00001"}

        async def write_once(num: int) -> None:
            if num == 3:  # after the get refused for too many keys: the first batch's is on its way
                for key in sorted(rewritten - {"k.00001"}):
                    await bus.kv_put("slots", key, b"late")
                await bus.kv_put("slots", "k.new", b"late")
                await bus.kv_delete("slots", "k.00001")
                written.set()

        seen = _counting_gets(monkeypatch, write_once)
        cursor, current = await kv.current("k.>")
        assert written.is_set() and seen["num"] == 1 + -(-NUM_KEYS // 1024)  # one refused (413), then the batches
        assert all(e.value != b"late" and not e.deleted and e.revision <= cursor.sequence for e in current)
        got = {e.key: e.value for e in current}
        assert got == {f"k.{i:05d}": _value(i) for i in range(NUM_KEYS) if f"k.{i:05d}" in got}
        assert set(got) >= {f"k.{i:05d}" for i in range(NUM_KEYS)} - rewritten
        assert cursor.sequence < (await bus.js_reads.stream_info("KV_slots")).state.last_seq


async def test_a_batch_that_fails_fails_the_read_and_leaves_no_subscription(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch refused (a 503: its stream went away) while the others are in flight: the read raises the
    bus's error naming the bucket,
    and the other batches' subscriptions are gone (none left receiving for a read nobody waits on)."""
    async with nats_bus(tmp_path) as bus:
        await _filled(bus)
        kv = await bus.kv("slots")
        real = runtime.bus.direct_get
        num_subscriptions = len(bus.nc._subs)
        calls = 0

        async def third_refused(nc: Any, stream: str, request: dict[str, Any], timeout_s: float) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                await asyncio.sleep(0.05)  # the others are in flight by now
                stream = "KV_gone"  # no such stream: the server answers 503 (no responders)
            return await real(nc, stream, request, timeout_s)

        monkeypatch.setattr(runtime.bus, "direct_get", third_refused)
        with pytest.raises(BusError, match="slots"):
            await bus.kv_items("slots", "k.>")
        assert len(bus.nc._subs) == num_subscriptions
        monkeypatch.setattr(runtime.bus, "direct_get", real)
        assert len(await bus.kv_items("slots", "k.>")) == NUM_KEYS  # the bus reads on
        assert kv.bucket == "slots"
