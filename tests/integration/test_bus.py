"""The bus's KV buckets on a real nats-server: listing keys while other clients write."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js.errors import NoKeysError

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
