"""A train order past the run's step budget is the expected end of a run (issue 30, item 7): the trainer drops it,
the base acks it and says so at info (``work_dropped``), and nothing is a warning, a failure or a dead letter, even
on the delivery that would have been the last. A real dead letter stays an error (tests/integration/test_poison_run.py).

The trainer's own `work` and the base's handling of a delivery (`Actor._process`), over a bus double that records
what is settled and dead-lettered (this unit is the path from the budget check to the settlement, not the bus)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgpack
from structlog.testing import capture_logs

from actors.config import RLConfig
from actors.reconciler.work import TrainOrder
from actors.stages.trainer import TrainerActor
from runtime.actor import ActorContext, ActorIdentity, ActorSettings
from runtime.bus import BusLimits

STEPS = 3
ORDER = TrainOrder("b7", 1, ("g0",), ("groups/g0",), ("s0", "s1"), STEPS, STEPS + 2, "t0k3n")


class _Bus:
    """Up, no outage; records dead letters, swallows the order's heartbeats and answers a redelivered order's
    question as a reconciler does while the batch is in its table (still wanted)."""

    def __init__(self) -> None:
        self.health = SimpleNamespace(num_outages=0, down=asyncio.Event())
        self.limits = BusLimits()
        self.dead_letters: list[str] = []

    async def publish(self, subject: str, data: bytes) -> None:
        pass

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        return msgpack.packb({"current": True})

    async def dead_letter(self, queue: str, reason: str, detail: str, data: bytes, **_: Any) -> None:
        self.dead_letters.append(detail)


class _Delivery:
    """One delivery of a work message; records how it was settled."""

    subject = "order.train"
    stream_sequence = 1
    msg_id = None

    def __init__(self, data: bytes, num_delivered: int) -> None:
        self.data = data
        self.num_delivered = num_delivered
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")

    async def in_progress(self) -> None:
        pass


async def test_an_order_past_the_step_budget_is_dropped_at_info_not_dead_lettered() -> None:
    bus = _Bus()
    settings = ActorSettings(max_deliveries=2)
    ctx = ActorContext(ActorIdentity.here("trainer", "trainer-1-ab", "h"), bus, settings,  # type: ignore[arg-type]
                       RLConfig(), run=SimpleNamespace(steps=STEPS))
    trainer = TrainerActor(ctx)
    trainer.learner = SimpleNamespace(version=STEPS, trained_groups={})  # type: ignore[assignment]
    data = await trainer.codec.encode(ORDER)
    # the first delivery, and the last one (past it the base would dead-letter a failing order)
    deliveries = [_Delivery(data, 1), _Delivery(data, settings.max_deliveries)]
    with capture_logs() as logs:
        for delivery in deliveries:
            trainer._inflight += 1  # as `_consume` counts it before `_process`
            await trainer._process(trainer.queues[0], delivery)  # type: ignore[arg-type]
    assert [d.settled for d in deliveries] == [["ack"], ["ack"]], "dropped for good, not retried"
    assert bus.dead_letters == []
    assert [e for e in logs if e["log_level"] not in ("info", "debug")] == [], "the end of a run needs nobody"
    dropped = [e for e in logs if e["event"] == "work_dropped"]
    assert len(dropped) == 2 and all("step budget (3) is reached" in e["reason"] for e in dropped), logs
    assert (trainer.num_failed, trainer.num_dead_lettered, trainer.num_handled) == (0, 0, 0)
