"""A stage's wait on a slow environment (tasks.latency): the drawn delay, and a drain that ends it at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors._stage import OrderGoesBack
from actors.stages.reward import RewardActor
from sandbox.latency import LatencyModel


def stage_without_a_bus() -> RewardActor:
    actor = object.__new__(RewardActor)  # the delay needs the drain signal alone: no bus, no process
    actor._drain_requested = asyncio.Event()
    return actor


async def test_the_stage_waits_the_drawn_delay() -> None:
    model = LatencyModel("lognormal", median_s=0.05, sigma=1.0, max_s=1.0)
    started = time.monotonic()
    waited = await stage_without_a_bus().environment_delay(model, "test/samples/e0-p0-s0/a0")
    assert waited == model.draw("test/samples/e0-p0-s0/a0") > 0
    assert time.monotonic() - started >= waited


async def test_off_waits_nothing() -> None:
    assert await stage_without_a_bus().environment_delay(LatencyModel(), "k") == 0.0


async def test_a_drain_ends_the_delay_at_once_and_gives_the_order_back() -> None:
    actor = stage_without_a_bus()
    model = LatencyModel("lognormal", median_s=60.0, sigma=0.0, max_s=60.0)
    waiting = asyncio.create_task(actor.environment_delay(model, "tool/e0-p0-s0/a0/0"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    started = time.monotonic()
    actor._drain_requested.set()
    with pytest.raises(OrderGoesBack, match="draining"):
        await asyncio.wait_for(waiting, 5.0)
    assert time.monotonic() - started < 1.0
