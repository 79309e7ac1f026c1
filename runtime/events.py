"""Structured event logs: structlog JSON lines to a file in the run directory and to ``log.<kind>.<level>``.

Every process of a run calls ``EventLog.install`` once at its entry point. Each event carries time, actor
kind and id, level and event name. The NATS side goes through a bounded queue drained by a forwarder
task: a log storm never blocks an actor; what does not fit is dropped, counted and reported.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import structlog

from runtime.config import Range, check_ranges, fixed

LEVELS = ("debug", "info", "warning", "error", "critical")


class Publisher(Protocol):
    """Where events go on the bus: `runtime.bus.Bus` (a core publish)."""

    async def publish(self, subject: str, data: bytes) -> None: ...


@dataclass(frozen=True)
class EventLogConfig:
    level: str = "info"
    queue_size: int = fixed(10_000, within=Range(1, 10_000_000))
    drop_report_interval_s: float = fixed(5.0, within=Range(0.0, 3600.0, lo_open=True))

    def __post_init__(self) -> None:
        check_ranges(self, "log")
        if self.level not in LEVELS:
            raise ValueError(f"log level {self.level!r} is not one of {LEVELS}")


class _Sink:
    """structlog's 'logger': receives each rendered JSON line under its level's method name."""

    def __init__(self, owner: EventLog) -> None:
        self._owner = owner

    def _emit(self, line: str, level: str) -> None:
        self._owner.emit(line, level)

    def debug(self, line: str) -> None:
        self._emit(line, "debug")

    def info(self, line: str) -> None:
        self._emit(line, "info")

    def warning(self, line: str) -> None:
        self._emit(line, "warning")

    def error(self, line: str) -> None:
        self._emit(line, "error")

    def critical(self, line: str) -> None:
        self._emit(line, "critical")

    msg = info
    exception = error
    warn = warning
    fatal = critical


class EventLog:
    """The process's event log. ``install`` configures structlog; ``forward`` ships events to NATS."""

    def __init__(self, path: Path, kind: str, actor_id: str, config: EventLogConfig = EventLogConfig(),
                 echo: IO[str] | None = None) -> None:
        self.path = path
        self.kind = kind
        self.actor_id = actor_id
        self.config = config
        self._echo = echo
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[str, str]] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_dropped = 0
        self.num_emitted = 0

    def install(self) -> None:
        """Makes structlog render JSON through this log; call once per process, at its entry point."""
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
                self._identity,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(default=_json_default),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(
                getattr(logging, self.config.level.upper())),
            logger_factory=lambda *_: _Sink(self),
            cache_logger_on_first_use=False,
        )

    def _identity(self, _logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("kind", self.kind)
        event.setdefault("actor", self.actor_id)
        return event

    def emit(self, line: str, level: str) -> None:
        with self._lock:
            self.num_emitted += 1
            if not self._file.closed:
                self._file.write(line + "\n")
            if self._echo is not None:
                self._echo.write(line + "\n")
            if self._loop is None:
                return
            if len(self._queue) >= self.config.queue_size:
                self.num_dropped += 1
                return
            self._queue.append((level, line))
        if self._wakeup is not None and self._loop is not None and not self._wakeup.is_set():
            # Wake the forwarder once per batch, not once per event (a storm would pay a syscall each).
            # A closed loop (shutdown) raises RuntimeError: the file still has the event.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wakeup.set)

    async def forward(self, bus: Publisher) -> None:
        """Publishes queued events to ``log.<kind>.<level>`` until cancelled.

        Drops are reported as a ``log_events_dropped`` warning at most once per
        ``drop_report_interval_s`` (a storm must not turn into a storm of reports), and once more
        when forwarding stops.
        """
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        reported = 0
        next_report = -math.inf  # loop time before which no drop report is due
        try:
            while True:
                pending = self.num_dropped != reported
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, next_report - self._loop.time()) if pending else None):
                        await self._wakeup.wait()
                self._wakeup.clear()
                await self._flush(bus)
                if self.num_dropped != reported and self._loop.time() >= next_report:
                    reported = self._report_drops(reported)
                    next_report = self._loop.time() + self.config.drop_report_interval_s
        finally:
            await self._flush(bus)
            if self.num_dropped != reported:
                self._report_drops(reported)
                await self._flush(bus)
            self._loop = None

    def _report_drops(self, reported: int) -> int:
        total = self.num_dropped
        structlog.get_logger(__name__).warning("log_events_dropped", num_dropped=total - reported,
                                               num_dropped_total=total)
        return total

    async def _flush(self, bus: Publisher) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                level, line = self._queue.popleft()
            try:
                await bus.publish(f"log.{self.kind}.{level}", line.encode())
            except Exception:  # the bus is gone: the file keeps the event
                with self._lock:
                    self.num_dropped += 1 + len(self._queue)
                    self._queue.clear()
                return

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "value"):  # enums
        return obj.value
    return repr(obj)


def parse_event(line: str | bytes) -> dict[str, Any] | None:
    """One event line back into a dict, or None for a line that is not a JSON object."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
