"""A promoted spare answers its control pings and keeps its lease while it takes over (`Actor.on_running`): a
reconciler's takeover of a big slot table can outlast its health bound, and a spare silent meanwhile was killed
as frozen. On a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest

from runtime.actor import Actor, ActorContext, ActorIdentity, ActorSettings
from runtime.bus_auth import control_subject
from runtime.errors import NoResponders
from runtime.registry import registration_key
from tests.integration.harness import nats_bus
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


class SlowTakeover(Actor):
    kind = "slow"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.taking_over, self.taken_over = asyncio.Event(), asyncio.Event()

    async def on_running(self) -> None:
        self.taking_over.set()
        await self.taken_over.wait()


async def test_a_promoted_spare_answers_pings_and_keeps_its_lease_while_it_takes_over(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        lease_s = 1.5
        identity = ActorIdentity.here("slow", "slow-1", "h")
        actor = SlowTakeover(ActorContext(identity, bus, ActorSettings(lease_s=lease_s), None))
        await actor.start()
        spare = asyncio.create_task(actor.stand_by())

        async def activated() -> bool:
            try:
                reply = await bus.request(control_subject("slow", "slow-1", "activate"), b"", timeout_s=1.0)
            except NoResponders:  # not subscribed yet
                return False
            return msgpack.unpackb(reply, raw=False)["ok"]

        await until(activated, 10, "the spare to take its activation")
        await asyncio.wait_for(spare, 10)
        running = asyncio.create_task(actor.run())
        try:
            await asyncio.wait_for(actor.taking_over.wait(), 10)
            for _ in range(3):  # over two leases into the takeover: still answering, still registered
                reply = msgpack.unpackb(await bus.request(control_subject("slow", "slow-1", "ping"), b"",
                                                          timeout_s=2.0), raw=False)
                assert reply["ok"], reply
                await asyncio.sleep(lease_s)
            assert await bus.kv_get("actors", registration_key("slow", "slow-1")) is not None, "its lease lapsed"
        finally:
            actor.taken_over.set()
            actor.request_drain()
            await asyncio.wait_for(running, 20)
