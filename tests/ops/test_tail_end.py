"""A following ``ops.tail`` ends with the run (issue 30: it followed a finished run until Ctrl-C): once the run's
state says it ended, the events sent before the end are shown, then the outcome, with runtime.up's exit status.
A stand-in bus (the LOG stream and the run bucket's state key as queues, the way `Bus.follow` and `Bus.kv_watch`
deliver them: forever, never ending by themselves); the real run's path is in tests/integration/test_tail.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ops import tail
from runtime.bus import FollowStart, StreamMessage
from runtime.kv_watch import KVEntry
from runtime.run_state import RUN_BUCKET, STATE_KEY, Outcome, RunState

BOUND_S = 10.0  # far above the idle wait after the end: a tail that does not end by itself fails here


@pytest.fixture(autouse=True)
def short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tail, "CATCH_UP_IDLE_S", 0.1)  # the wait after the end for what was sent before it


class StandInBus:
    def __init__(self, state: RunState | None = None) -> None:
        self.log: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.states: asyncio.Queue[RunState] = asyncio.Queue()
        self.current = state
        self.revision = 0

    async def follow(self, subject: str, start: FollowStart = "new") -> AsyncIterator[StreamMessage]:
        assert subject == "log.>"
        sequence = 0
        while True:
            event = await self.log.get()
            sequence += 1
            yield StreamMessage(f"log.{event['kind']}.info", json.dumps(event).encode(), sequence, 0)

    async def kv_watch(self, bucket: str, keys: str = ">") -> AsyncIterator[KVEntry | None]:
        assert (bucket, keys) == (RUN_BUCKET, STATE_KEY)
        if self.current is not None:
            yield self._entry(self.current)
        yield None
        while True:
            yield self._entry(await self.states.get())

    def _entry(self, state: RunState) -> KVEntry:
        self.revision += 1
        return KVEntry(STATE_KEY, state.to_bytes(), self.revision)


def event(name: str) -> dict[str, Any]:
    return {"time": "2026-12-04T00:00:00+00:00", "level": "info", "event": name, "kind": "supervisor"}


async def test_a_follower_ends_with_the_run_after_the_events_sent_before_the_end() -> None:
    bus = StandInBus(RunState(Outcome.RUNNING))
    shown: list[str] = []

    async def run_then_fail() -> None:
        await bus.log.put(event("actor_spawned"))
        await bus.states.put(RunState(Outcome.FAILED, "restart intensity exceeded"))
        await bus.log.put(event("supervisor_stopped"))  # sent before the end, arriving after it

    async with asyncio.timeout(BOUND_S):
        feeding = asyncio.create_task(run_then_fail())
        ended = await tail.read_bus(bus, None, False, True, lambda line, e: shown.append(e["event"]))  # type: ignore[arg-type]
        await feeding
    assert ended == RunState(Outcome.FAILED, "restart intensity exceeded")
    assert shown == ["actor_spawned", "supervisor_stopped"]


async def test_a_follower_of_a_run_that_has_ended_ends_at_once() -> None:
    bus = StandInBus(RunState(Outcome.FINISHED))
    async with asyncio.timeout(BOUND_S):
        ended = await tail.read_bus(bus, None, False, True, lambda line, e: None)  # type: ignore[arg-type]
    assert ended is not None and ended.outcome is Outcome.FINISHED


async def test_a_run_that_has_not_ended_is_followed_on() -> None:
    bus = StandInBus(RunState(Outcome.RUNNING))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(5 * tail.CATCH_UP_IDLE_S):
            await tail.read_bus(bus, None, False, True, lambda line, e: None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("outcome", "status"), [(Outcome.FINISHED, 0), (Outcome.STOPPED, 0), (Outcome.FAILED, 1)])
def test_the_outcome_is_said_with_runtime_ups_exit_status(outcome: Outcome, status: int,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert tail.say_end(Path("runs/r"), RunState(outcome, "why" if outcome is Outcome.FAILED else "")) == status
    done = capsys.readouterr()
    assert done.out == ""  # stdout carries the run's events only (JSON lines for jq with --json)
    assert done.err == f"ops.tail: run runs/r {outcome.value}{': why' if outcome is Outcome.FAILED else ''}\n"
