"""The run's watchdog: a run in which nothing advances for ``supervisor.stall_s`` says so loudly,
naming the stage that holds it.

The runtime knows nothing of RL, so "advancing" is what every stage does when it finishes work: it
acknowledges a message of its work queue, which removes it from the queue's stream (work-queue
retention), or something reports on ``progress.>``. The watchdog reads every queue's stream state
(one request for all), is woken early by progress reports, and when nothing was acknowledged for
``stall_s`` it logs ``run_stalled`` (error) and prints one line naming the queue that holds the run:
the one with the most messages waiting or in flight, or none (no stage has work: nothing issues
any). It says so again every ``stall_s`` while the stall lasts, and ``run_advancing`` once it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import structlog

from runtime.bus import Bus

log = structlog.get_logger(__name__)

QUEUE_STREAM_PREFIX = "Q_"  # runtime.bus.Queue.stream
PROGRESS_SUBJECTS = "progress.>"
REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class QueueState:
    """One work queue's stream: where its messages went."""

    subject: str  # what the queue consumes, e.g. work.rollout
    num_finished: int  # messages acknowledged (removed) since the stream began: grows as its stage works
    num_outstanding: int  # messages waiting or in flight


@dataclass(frozen=True)
class Stall:
    """Nothing advanced for ``stalled_s``; ``holder`` is the queue whose messages are not finishing."""

    stalled_s: float
    holder: QueueState | None
    queues: tuple[QueueState, ...]

    def describe(self) -> str:
        if self.holder is None:
            where = "no stage has work: nothing issues any (the producer of work holds the run)"
        else:
            where = (f"held by {self.holder.subject}: {self.holder.num_outstanding} messages waiting or in "
                     "flight, none finished (its actors are wedged, gone or failing every message)")
        return f"run stalled: nothing advanced for {self.stalled_s:.0f}s; {where}"


class Watchdog:
    """Watches a run's queues; see the module docstring. ``run()`` returns only when cancelled."""

    def __init__(self, bus: Bus, stall_s: float, terminal: IO[str] | None = None,
                 on_stall: Callable[[Stall], None] | None = None) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s={stall_s} must be > 0 (0 in the configuration disables the watchdog)")
        self.bus = bus
        self.stall_s = stall_s
        self.terminal = terminal if terminal is not None else sys.stderr
        self.on_stall = on_stall
        self._reported = asyncio.Event()

    async def run(self) -> None:
        sub = await self.bus.subscribe(PROGRESS_SUBJECTS, self._on_progress)
        try:
            await self._watch()
        finally:
            await sub.unsubscribe()  # bounded, and quiet on a closed connection

    async def _on_progress(self, _msg: object) -> None:
        self._reported.set()

    async def _watch(self) -> None:
        check_s = max(0.1, self.stall_s / 4)
        last_advance = time.monotonic()
        last_said = -float("inf")
        finished: dict[str, int] = {}
        stalled = False
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(check_s):
                    await self._reported.wait()
            reported, now = self._reported.is_set(), time.monotonic()
            self._reported.clear()
            queues = await self._queues()
            if queues is None:  # the bus is down: its own guard bounds that; no verdict on the stages
                continue
            advanced = reported or any(q.num_finished > finished.get(q.subject, q.num_finished) for q in queues)
            finished = {q.subject: q.num_finished for q in queues}
            if advanced:
                if stalled:
                    log.info("run_advancing", after_s=round(now - last_advance, 1))
                last_advance, stalled = now, False
            elif now - last_advance >= self.stall_s and now - last_said >= self.stall_s:
                stall = _stall(now - last_advance, queues)
                self._say(stall)
                stalled, last_said = True, now

    async def _queues(self) -> tuple[QueueState, ...] | None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                streams = await self.bus.stream_states()
        except OSError as e:  # BusError included
            log.debug("watchdog_no_reading", error=repr(e))
            return None
        return tuple(
            QueueState(",".join(s.subjects or [s.name]), s.last_sequence - s.num_messages, s.num_messages)
            for s in streams if s.name.startswith(QUEUE_STREAM_PREFIX))

    def _say(self, stall: Stall) -> None:
        holder = stall.holder
        log.error("run_stalled", stalled_s=round(stall.stalled_s, 1), stage=holder.subject if holder else None,
                  num_outstanding=holder.num_outstanding if holder else 0,
                  queues={q.subject: q.num_outstanding for q in stall.queues})
        print(f"\n{stall.describe()}", file=self.terminal, flush=True)
        if self.on_stall is not None:
            self.on_stall(stall)


def _stall(stalled_s: float, queues: tuple[QueueState, ...]) -> Stall:
    busy = [q for q in queues if q.num_outstanding > 0]
    holder = max(busy, key=lambda q: q.num_outstanding) if busy else None
    return Stall(stalled_s, holder, queues)
