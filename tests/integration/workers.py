"""Actor kinds used by the runtime's integration tests (started for real by runtime.up)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import msgpack

from runtime.actor import Actor, Delivery
from runtime.bus import work_queue
from runtime.bus_auth import BusAccess
from runtime.codec import message
from runtime.config import live
from runtime.errors import RevisionMismatch


@message("test.count")
class CountRequest:
    key: str
    sleep_s: float = 0.0


@dataclass(frozen=True)
class CounterSection:
    delay_scale: float = live(1.0)
    note: str = "fixed"


@dataclass(frozen=True)
class CounterConfig:
    counter: CounterSection = CounterSection()


class CounterActor(Actor):
    """Sleeps, then records its effect once per key (KV create): at-least-once in, once in effect."""

    kind = "counter"
    queues = (work_queue("count"),)
    bus_access = BusAccess(publish=("test.>",), kv_write=("effects",))
    messages = (CountRequest,)
    Config = CounterConfig

    async def setup(self) -> None:
        await self.bus.kv("effects")  # made before any handler writes to it

    async def handle(self, msg: CountRequest, delivery: Delivery) -> None:  # type: ignore[override]
        await self.bus.publish("test.started", msgpack.packb(
            {"key": msg.key, "actor": self.identity.actor_id, "n": delivery.num_delivered}))
        delivery.task_group.create_task(asyncio.sleep(msg.sleep_s * self.config.counter.delay_scale))
        await asyncio.sleep(msg.sleep_s * self.config.counter.delay_scale)
        record = msgpack.packb({"actor": self.identity.actor_id, "code_hash": self.identity.code_hash})
        try:
            await self.bus.kv_create("effects", msg.key, record)
            duplicate = False
        except RevisionMismatch:
            duplicate = True  # a redelivery of work whose effect already happened
        await self.bus.publish("test.handled", msgpack.packb(
            {"key": msg.key, "actor": self.identity.actor_id, "duplicate": duplicate,
             "code_hash": self.identity.code_hash}))

    def status(self) -> dict:
        return {"delay_scale": self.config.counter.delay_scale}


class CrashingActor(Actor):
    """Dies during start-up, every time: exercises the restart intensity limit."""

    kind = "crasher"

    async def setup(self) -> None:
        os._exit(3)


@message("test.fault")
class FaultRequest:
    key: str
    fault: str = ""  # "": handled; "raise": the handler always raises; "exit": the handler kills its process


class FaultyActor(Actor):
    """Handles ``work.fault``: a poison message raises, or takes its process down, every delivery."""

    kind = "faulty"
    queues = (work_queue("fault"),)
    bus_access = BusAccess(publish=("test.>",))
    messages = (FaultRequest,)

    async def handle(self, msg: FaultRequest, delivery: Delivery) -> None:  # type: ignore[override]
        if msg.fault == "raise":
            raise LookupError(f"no handler for {msg.key!r}")
        if msg.fault == "exit":
            os._exit(7)
        await self.bus.publish("test.handled", msgpack.packb({"key": msg.key, "n": delivery.num_delivered}))


class StubbornActor(Actor):
    """Fails its own stop (its handover raises): the supervisor must say so, not only "stopped"."""

    kind = "stubborn"

    async def handover(self) -> dict | None:
        raise RuntimeError("cannot hand over: state lost")


def first_time_in_run(run_dir: str | Path, fault: str) -> bool:
    """True once per run (a marker file in the run directory): a fault injected in the first process only,
    so that its replacement is healthy."""
    try:
        (Path(run_dir) / f"fault-{fault}").touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


class AilingCounterActor(CounterActor):
    """The counter, made unhealthy by the key it is given, in the first process of the run only (a marker
    file says it happened, so its replacement is healthy): ``ail-hang`` never finishes its handling,
    ``ail-probe`` makes its probe fail from then on while it goes on serving (an engine dead in a live
    process), ``ail-errors`` makes every handling fail from then on (its engine broke, its pings still
    answer). The freeze case needs no code: the test stops the process (SIGSTOP)."""

    kind = "ailing"

    async def setup(self) -> None:
        await super().setup()
        self.probe_broken = False
        self.handling_broken = False

    def _first_time(self, fault: str) -> bool:
        return first_time_in_run(self.ctx.run_dir, fault)

    async def handle(self, msg: CountRequest, delivery: Delivery) -> None:  # type: ignore[override]
        if msg.key == "ail-hang" and self._first_time("hang"):
            await asyncio.Event().wait()  # a handler that never returns, in a process that answers pings
        if msg.key == "ail-probe" and self._first_time("probe"):
            self.probe_broken = True
        if msg.key == "ail-errors" and self._first_time("errors"):
            self.handling_broken = True
        if self.handling_broken:
            raise RuntimeError("injected fault: every handling fails in this process")
        await super().handle(msg, delivery)

    async def probe(self) -> None:
        if self.probe_broken:
            raise RuntimeError("injected fault: the engine stopped decoding")

