"""The question a redelivered order asks before it is done ("is this attempt still wanted?"), on a real bus,
while no reconciler can answer: it waits for the next reconciler, gives up after its patience, and gives
the order back when its actor drains."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest

from actors._stage import OrderGoesBack, StageActor
from actors.config import RLConfig
from actors.messages import RECONCILER_KIND
from actors.reconciler.slot import Stage
from actors.reconciler.work import RewardOrder
from runtime.actor import ActorContext, ActorIdentity, ActorSettings
from runtime.bus import Bus
from runtime.registry import registration_key
from tests.integration.harness import nats_bus

pytestmark = pytest.mark.timeout(60)

ORDER = RewardOrder("e0-p0-s0", 1, "p0", "e0-p0", "samples/e0-p0-s0/a1/trajectory", "t0k3n")


class _Reward(StageActor):
    stage = Stage.REWARD


def _stage(bus: Bus, patience_s: float = 20.0) -> _Reward:
    actor = _Reward(ActorContext(ActorIdentity.here("reward", "reward-1", "h"), bus, ActorSettings(), RLConfig()))
    actor.still_wanted_patience_s = patience_s
    return actor


async def _answer(bus: Bus, current: bool) -> None:
    """A reconciler coming up: subscribed to the heartbeats first, registered then."""
    async def on_heartbeat(msg: object) -> None:
        await bus.respond(msg, msgpack.packb({"current": current}))  # type: ignore[arg-type]

    await bus.subscribe("heartbeat.>", on_heartbeat)
    await bus.kv_put("actors", registration_key(RECONCILER_KIND, f"{RECONCILER_KIND}-2-ab"), b"{}")


async def test_the_question_waits_for_the_next_reconciler_and_takes_its_answer(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        await bus.kv_put("actors", registration_key(RECONCILER_KIND, f"{RECONCILER_KIND}-1-cd"), b"{}")  # lapsing
        actor = _stage(bus)
        asking = asyncio.create_task(actor._still_wanted(ORDER))
        await asyncio.sleep(1.0)
        assert not asking.done(), "no reconciler answers: the question waits (the dead one's entry tells nothing)"
        started = time.monotonic()
        await _answer(bus, current=False)
        assert await asyncio.wait_for(asking, 10) is False, "the new reconciler's answer: superseded, skipped"
        assert time.monotonic() - started < 5


async def test_without_any_reconciler_the_order_is_done_after_the_patience(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        started = time.monotonic()
        assert await _stage(bus, patience_s=1.5)._still_wanted(ORDER) is True
        assert 1.5 <= time.monotonic() - started < 5


async def test_a_draining_actor_gives_the_order_back_instead_of_waiting(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        actor = _stage(bus)
        asking = asyncio.create_task(actor._still_wanted(ORDER))
        await asyncio.sleep(0.5)
        actor.request_drain()
        with pytest.raises(OrderGoesBack):
            await asyncio.wait_for(asking, 5)
