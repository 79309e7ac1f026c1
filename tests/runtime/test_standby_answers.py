"""A warm spare answers control requests before its registry entry says ``standby`` (issue 30, item 8): the
supervisor's health checks start pinging once the entry says it (`runtime.health`), and a spare that registered
first and subscribed after failed its first liveness check at every start of a run with spares
(``health_check_failed ... nothing listens on ctl.<kind>.<id>.ping``), with nothing for a person to do.

`Actor.stand_by` over a bus double that notes, at each registration, whether the control subject is listened to."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgpack

from runtime.actor import Actor, ActorContext, ActorIdentity, ActorSettings
from runtime.bus_auth import control_subject


class _Bus:
    def __init__(self) -> None:
        self.health = SimpleNamespace(down=asyncio.Event())
        self.listened: set[str] = set()
        self.registered: list[tuple[str, bool]] = []  # (state, whether its control subject was listened to)
        self.standing_by = asyncio.Event()

    async def kv_put(self, bucket: str, key: str, value: bytes, ttl_s: float | None = None) -> None:
        state = msgpack.unpackb(value, raw=False)["state"]
        self.registered.append((state, control_subject("worker", "worker-1-ab") in self.listened))
        if state == "standby":
            self.standing_by.set()

    async def subscribe(self, subject: str, handler: Any) -> Any:
        self.listened.add(subject)

        async def unsubscribe() -> None:
            self.listened.discard(subject)

        return SimpleNamespace(unsubscribe=unsubscribe)


class _Worker(Actor):
    kind = "worker"


async def test_a_spare_answers_pings_before_it_registers_as_standby() -> None:
    bus = _Bus()
    spare = _Worker(ActorContext(ActorIdentity.here("worker", "worker-1-ab", "h"), bus,  # type: ignore[arg-type]
                                 ActorSettings(), None))
    await spare.start()
    standing = asyncio.create_task(spare.stand_by())
    await asyncio.wait_for(bus.standing_by.wait(), 5)
    spare.request_drain()
    await asyncio.wait_for(standing, 5)
    assert ("standby", True) in bus.registered and ("standby", False) not in bus.registered, bus.registered
