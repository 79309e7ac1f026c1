"""Follow or replay a run's event log: ``python -m ops.tail [RUN_DIR] [filters]``.

Live: the run's LOG stream (``log.>``); new events by default, or from a past time (``--since 10m``,
``--since 2026-01-02T03:04:05Z``) or from the start. Following ends with the run: once its ``runtime.up``
records how it ended (the run bucket's ``state``, watched), the events still on their way are shown, then the
outcome (on stderr) and the exit status: 0 finished or stopped, 1 failed. Offline (``--files``, or
automatically when the bus does not answer): the JSONL files under RUN_DIR/logs, merged by time.
Filters combine with AND; repeated ``--actor``/``--event``/``--where`` values of one flag combine
with OR (``--where``: AND). Output is one readable line per event (coloured on a terminal), or the
raw JSON line with ``--json`` for jq. Times are UTC; a timestamp without a zone is read as UTC.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import heapq
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import structlog

from ops._client import connect_or_none, fail, resolve_run_dir
from runtime.bus import Bus, FollowStart
from runtime.errors import ConfigError
from runtime.events import LEVELS, parse_event
from runtime.run_state import Outcome, RunState, run_ended

T = TypeVar("T")

IDENTITY_KEYS = ("time", "level", "event", "kind", "actor")
CONNECT_TIMEOUT_S = 3.0  # a run that does not answer within this is read from its files
SKEW_MARGIN_S = 5.0  # the stream's clock may lag an actor's: ask the server from a little earlier
CATCH_UP_IDLE_S = 1.0  # --no-follow on the bus, or a run that ended: stop when nothing more arrives within this
STOP_GRACE_S = 15.0  # Ctrl-C: the tail's own cleanup (the follow's unsubscribe, Bus.close) gets this long

_RELATIVE = re.compile(r"^(?:(\d+(?:\.\d+)?)([smhd]))+$")
_RELATIVE_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_COLORS = {"debug": "2", "info": "32", "warning": "33", "error": "31", "critical": "1;31"}


# --- parsing ---------------------------------------------------------------------------------------
def parse_time(text: str, now: datetime) -> datetime:
    """An absolute ISO 8601 time or a duration before ``now`` (``30s``, ``10m``, ``2h``, ``1h30m``)."""
    text = text.strip()
    if _RELATIVE.match(text):
        seconds = sum(float(n) * _UNITS[u] for n, u in _RELATIVE_PART.findall(text))
        return now - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither an ISO time (2026-01-02T03:04:05Z) "
            "nor a duration such as 30s, 10m, 2h or 1h30m"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def parse_where(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--where {text!r} must look like key=value")
    return key.strip(), value


def event_time(event: dict[str, Any]) -> datetime | None:
    try:
        when = datetime.fromisoformat(str(event["time"]))
    except (KeyError, ValueError):
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


# --- filtering -------------------------------------------------------------------------------------
def _rank(level: Any) -> int:
    """Position of a level in LEVELS; an unknown level ranks above all, so no level filter hides it."""
    return LEVELS.index(level) if level in LEVELS else len(LEVELS)


def _field_equals(value: Any, wanted: str) -> bool:
    if isinstance(value, str):
        return value == wanted
    return json.dumps(value) == wanted or str(value) == wanted


@dataclass(frozen=True)
class EventFilter:
    """Which events to show; an empty criterion matches everything."""

    actors: tuple[str, ...] = ()  # actor kinds or ids
    min_level: str | None = None
    events: tuple[str, ...] = ()  # glob patterns over the event name
    where: tuple[tuple[str, str], ...] = ()
    grep: re.Pattern[str] | None = None
    since: datetime | None = None

    def __post_init__(self) -> None:
        if self.min_level is not None and self.min_level not in LEVELS:
            raise ValueError(f"--level {self.min_level!r} is not one of {', '.join(LEVELS)}")

    def matches(self, line: str, event: dict[str, Any]) -> bool:
        if self.actors and not any(a in (event.get("kind"), event.get("actor")) for a in self.actors):
            return False
        if self.min_level is not None and _rank(event.get("level")) < LEVELS.index(self.min_level):
            return False
        if self.events and not any(fnmatch.fnmatchcase(str(event.get("event", "")), p) for p in self.events):
            return False
        if not all(k in event and _field_equals(event[k], v) for k, v in self.where):
            return False
        if self.grep is not None and not self.grep.search(line):
            return False
        if self.since is not None:
            when = event_time(event)
            return when is not None and when >= self.since
        return True


# --- formatting ------------------------------------------------------------------------------------
def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color else text


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and not any(c.isspace() or c in '"=' for c in value) else json.dumps(value)
    return json.dumps(value, separators=(",", ":"), default=str)


def format_event(event: dict[str, Any], color: bool = False) -> str:
    """``MM-DD HH:MM:SS.mmm LEVEL actor event key=value ...``, the traceback (if any) below."""
    when = event_time(event)
    stamp = when.strftime("%m-%d %H:%M:%S.%f")[:-3] if when else str(event.get("time", "?"))
    level = str(event.get("level", "?"))
    fields = {k: v for k, v in event.items() if k not in IDENTITY_KEYS and k != "exception"}
    parts = [
        _paint(stamp, "2", color),
        _paint(f"{level.upper():<8}", _COLORS.get(level, "0"), color),
        _paint(str(event.get("actor", event.get("kind", "?"))), "36", color),
        _paint(str(event.get("event", "?")), "1", color),
        *(f"{_paint(k, '2', color)}={_value(v)}" for k, v in fields.items()),
    ]
    text = " ".join(parts)
    if "exception" in event:
        text += "\n" + "\n".join("    " + ln for ln in str(event["exception"]).splitlines())
    return text


# --- sources ---------------------------------------------------------------------------------------
def read_files(paths: Iterable[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every event of the JSONL files, merged by time (each file is already in time order)."""
    floor = datetime.min.replace(tzinfo=UTC)

    def one(path: Path) -> Iterator[tuple[datetime, str, dict[str, Any]]]:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if (event := parse_event(line)) is not None:
                    yield event_time(event) or floor, line.rstrip("\n"), event

    for _, line, event in heapq.merge(*(one(p) for p in paths), key=lambda item: item[0]):
        yield line, event


class LogReader:
    """Events from the LOG stream: new ones, from ``start`` or from the beginning, each given to ``show``.

    Following, it reads until `wind_down` (the run ended), then until nothing has arrived for
    ``CATCH_UP_IDLE_S`` (what was sent before the end; a bus going down with the run sends nothing more); not
    following, until it has what the stream holds (or nothing arrives for that long)."""

    def __init__(self, bus: Bus, start: datetime | None, from_start: bool, follow: bool,
                 show: Callable[[str, dict[str, Any]], None]) -> None:
        self.bus = bus
        self.where: FollowStart = "new"
        if from_start:
            self.where = "all"
        elif start is not None:
            self.where = start - timedelta(seconds=SKEW_MARGIN_S)
        self.follow = follow
        self.show = show
        self._idle_s: float | None = None if follow else CATCH_UP_IDLE_S
        self._waiting: asyncio.Timeout | None = None  # the wait for the next event, while one is waited for

    def wind_down(self) -> None:
        """The run has ended: read on until nothing arrives for ``CATCH_UP_IDLE_S``, the wait under way included."""
        self._idle_s = CATCH_UP_IDLE_S
        if self._waiting is not None and self._waiting.when() is None:
            self._waiting.reschedule(asyncio.get_running_loop().time() + CATCH_UP_IDLE_S)

    async def run(self) -> None:
        messages = aiter(self.bus.follow("log.>", self.where))  # renewed after a bus outage, from where it stopped
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle_s) as self._waiting:
                        msg = await anext(messages)
                except TimeoutError:
                    return
                finally:
                    self._waiting = None
                line = msg.data.decode(errors="replace")
                if (event := parse_event(line)) is not None:
                    self.show(line, event)
                if not self.follow and msg.num_pending == 0:
                    return
        finally:
            await messages.aclose()  # type: ignore[attr-defined]


async def read_bus(
    bus: Bus, start: datetime | None, from_start: bool, follow: bool, show: Callable[[str, dict[str, Any]], None]
) -> RunState | None:
    """Events from the LOG stream (`LogReader`); following, until the run ends: returns how it ended."""
    reader = LogReader(bus, start, from_start, follow, show)
    if not follow:
        await reader.run()
        return None
    async with asyncio.TaskGroup() as tg:
        tg.create_task(reader.run())
        ended = await run_ended(bus)
        reader.wind_down()
    return ended


# --- command ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ops.tail", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dir", nargs="?", type=Path, help="the run (default: the newest under runs/)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--since", metavar="TIME", help="replay from TIME: ISO 8601, or 30s, 10m, 2h ago")
    when.add_argument("--from-start", action="store_true", help="replay everything the stream keeps")
    p.add_argument("--files", action="store_true", help="read RUN_DIR/logs/*.jsonl, not the bus")
    p.add_argument("--no-follow", action="store_true", help="print what matches now, then exit")
    p.add_argument("--actor", action="append", default=[], help="actor kind or id (repeatable)")
    p.add_argument("--level", choices=LEVELS, help="minimum level")
    p.add_argument("--event", action="append", default=[], metavar="GLOB", help="event name glob (repeatable)")
    p.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="field equality, e.g. --where queue=work_count (repeatable)",
    )
    p.add_argument("--grep", metavar="REGEX", help="regular expression over the raw JSON line")
    p.add_argument("--json", action="store_true", help="raw JSON lines (for jq)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    return p


def build_filter(args: argparse.Namespace, now: datetime) -> EventFilter:
    return EventFilter(
        actors=tuple(args.actor),
        min_level=args.level,
        events=tuple(args.event),
        where=tuple(parse_where(w) for w in args.where),
        grep=re.compile(args.grep) if args.grep else None,
        since=parse_time(args.since, now) if args.since else None,
    )


def make_printer(filt: EventFilter, as_json: bool, color: bool) -> Callable[[str, dict[str, Any]], None]:
    def show(line: str, event: dict[str, Any]) -> None:
        if filt.matches(line, event):
            print(line if as_json else format_event(event, color), flush=True)

    return show


async def _connect_or_none(run_dir: Path) -> Bus | None:
    bus, reason = await connect_or_none(run_dir, "ops-tail", CONNECT_TIMEOUT_S)
    if bus is None:
        print(
            f"ops.tail: the bus of {run_dir} is not reachable ({reason}); "
            f"reading what {run_dir / 'logs'} holds now instead (no following)",
            file=sys.stderr,
        )
    return bus


async def tail(
    args: argparse.Namespace, run_dir: Path, show: Callable[[str, dict[str, Any]], None], since: datetime | None
) -> RunState | None:
    """Shows the run's events; following its bus, returns how the run ended (None: not following it)."""
    bus = None if args.files else await _connect_or_none(run_dir)
    if bus is None:
        files = sorted((run_dir / "logs").glob("*.jsonl"))
        if not files:
            print(f"ops.tail: no event logs (*.jsonl) under {run_dir / 'logs'}", file=sys.stderr)
        for line, event in read_files(files):
            show(line, event)
        return None
    try:
        return await read_bus(bus, since, args.from_start, not args.no_follow, show)
    finally:
        await bus.close()


def say_end(run_dir: Path, state: RunState) -> int:
    """The run's outcome on stderr (stdout carries its events, JSON for jq with --json); the exit status of
    runtime.up for it: 1 failed, else 0."""
    failure = f": {state.failure}" if state.failure else ""
    print(f"ops.tail: run {run_dir} {state.outcome.value}{failure}", file=sys.stderr, flush=True)
    return 1 if state.outcome is Outcome.FAILED else 0


async def until_interrupted(work: Awaitable[T]) -> T:
    """``work``, cancelled by Ctrl-C (SIGINT) or SIGTERM; if it has not ended ``STOP_GRACE_S`` later, the
    process exits anyway (130). A cancellation can be lost inside the NATS client (nats-py's flush
    swallows CancelledError), which left a tail following after Ctrl-C."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None

    def give_up() -> None:
        print(f"ops.tail: not stopped within {STOP_GRACE_S}s of the interrupt; exiting", file=sys.stderr, flush=True)
        os._exit(130)

    def interrupt() -> None:
        main_task.cancel()
        loop.call_later(STOP_GRACE_S, give_up)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupt)
    return await work


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # This process's own library events go to stderr, errors only: stdout carries the run's events.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
    )
    try:
        filt = build_filter(args, datetime.now(UTC))
        run_dir = resolve_run_dir(args.run_dir)
    except (ValueError, re.error, ConfigError) as e:
        return fail(str(e))
    if not run_dir.is_dir():
        return fail(f"{run_dir} is not a directory; pass a run directory made by python -m runtime.up")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    try:
        ended = asyncio.run(until_interrupted(tail(args, run_dir, make_printer(filt, args.json, color), filt.since)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except BrokenPipeError:  # piped into head: the reader is gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 0 if ended is None else say_end(run_dir, ended)


if __name__ == "__main__":
    sys.exit(main())
