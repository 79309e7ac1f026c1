"""A probe in flight does not hold up pings: a control subscription hands its handler one request at a time,
and a probe of a wedged engine waits out its whole timeout, so the pings queued behind it went unanswered and
a live process got a liveness verdict (killed) where a readiness verdict (drained) was due. On a real
nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest

from runtime.actor import Actor, ActorContext, ActorIdentity, ActorSettings
from runtime.bus_auth import control_subject
from runtime.errors import BusTimeout, NoResponders
from tests.integration.harness import nats_bus
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


class WedgedProbe(Actor):
    kind = "wedged"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.probing, self.unwedged = asyncio.Event(), asyncio.Event()

    async def probe(self) -> None:
        self.probing.set()
        await self.unwedged.wait()
        raise RuntimeError("the engine was wedged")


async def _ask(bus, actor_id: str, verb: str, timeout_s: float) -> dict:
    return msgpack.unpackb(await bus.request(control_subject("wedged", actor_id, verb), b"", timeout_s=timeout_s),
                           raw=False)


async def _running(bus, actor_id: str) -> tuple[WedgedProbe, asyncio.Task[None]]:
    actor = WedgedProbe(ActorContext(ActorIdentity.here("wedged", actor_id, "h"), bus, ActorSettings(), None))
    await actor.start()
    running = asyncio.create_task(actor.run())

    async def answers() -> bool:
        try:
            return (await _ask(bus, actor_id, "ping", 1.0))["ok"]
        except NoResponders:  # not subscribed yet
            return False

    await until(answers, 10, "the actor to answer its first ping")
    return actor, running


async def test_pings_are_answered_while_a_probe_waits_and_the_probe_still_gets_its_answer(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        actor, running = await _running(bus, "w-1")
        try:
            probe = asyncio.create_task(_ask(bus, "w-1", "probe", 20.0))
            await asyncio.wait_for(actor.probing.wait(), 10)
            for _ in range(3):
                assert (await _ask(bus, "w-1", "ping", 2.0))["ok"], "a ping waited behind the probe in flight"
            actor.unwedged.set()
            answer = await probe
            assert answer["ok"] is False and "wedged" in answer["error"], answer
        finally:
            actor.request_drain()
            await asyncio.wait_for(running, 20)


async def test_a_probe_in_flight_when_the_actor_stops_is_cancelled_not_left_behind(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        actor, running = await _running(bus, "w-2")
        probe = asyncio.create_task(_ask(bus, "w-2", "probe", 3.0))
        await asyncio.wait_for(actor.probing.wait(), 10)
        actor.request_drain()
        await asyncio.wait_for(running, 20)
        assert not actor._probes_in_flight, "a probe's task outlived the actor"
        with pytest.raises(BusTimeout):  # cancelled with the actor: never answered
            await probe
