"""Where the dashboard's view of a run comes from.

Live (the run's bus answers): the event log replayed from its start and then followed (``log.>`` through
an ordered consumer that survives bus outages), the live configuration watched in its KV bucket, and a
status sample (registry, reconciler and trainer status) every ``sample_s``: the slot table and the
actors are state, not events, so a chart of them over time is a series of samples. Offline (a finished
run, or one whose bus does not answer): the event files under RUN_DIR/logs, read once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import structlog
from nats.js.api import ConsumerConfig, DeliverPolicy

from ops import config as ops_config
from ops import status as ops_status
from ops.dashboard.model import RunView
from ops.tail import read_files
from runtime.bus import Bus
from runtime.errors import BusError
from runtime.events import parse_event

log = structlog.get_logger()


def load_event_files(run_dir: Path, view: RunView) -> int:
    """Every event in RUN_DIR/logs, merged by time, into ``view``; returns how many."""
    paths = sorted((run_dir / "logs").glob("*.jsonl"))
    count = 0
    for _, event in read_files(paths):
        view.add_event(event)
        count += 1
    return count


async def follow_events(bus: Bus, view: RunView) -> None:
    """The run's whole event log, then every new event, into ``view``. Runs until cancelled."""
    messages = aiter(bus.follow("log.>", ConsumerConfig(deliver_policy=DeliverPolicy.ALL)))
    try:
        async for msg in messages:
            if (event := parse_event(msg.data.decode(errors="replace"))) is not None:
                view.add_event(event)
    finally:
        await messages.aclose()  # type: ignore[attr-defined]


async def watch_config(bus: Bus, view: RunView) -> None:
    """The live configuration (the ``config`` bucket) into ``view``: its values now, then each change."""
    items: dict[str, object] = {}
    caught_up = False
    async for entry in bus.watch_kv("config"):
        if entry is None:  # the current values are all in: show them at once, then each change
            caught_up = True
        elif entry.operation in ("DEL", "PURGE") or not entry.value:
            items.pop(entry.key, None)
        else:
            try:
                items[entry.key] = msgpack.unpackb(entry.value, raw=False)
            except (ValueError, TypeError) as e:  # shown as what it is, beside the good values
                items[entry.key] = f"<malformed: {e}>"
        if caught_up:
            view.set_config(dict(items))


async def sample_status(bus: Bus, view: RunView, sample_s: float) -> None:
    """A status sample every ``sample_s`` (the slot table and actors over time). A run that does not
    answer one sample is shown as such (``unanswered``) and sampled again at the next tick."""
    while True:
        started = time.monotonic()
        try:
            status = await ops_status.snapshot(bus)
        except BusError as e:
            status = {"actors": [], "unanswered": [{"id": "registry", "error": str(e)}]}
        view.set_status(status, time.time())
        # a sampling clock, not a wait for a condition: the next sample is due sample_s after this one
        await asyncio.sleep(max(0.0, sample_s - (time.monotonic() - started)))


async def set_live_key(bus: Bus, run_dir: Path, key: str, raw_value: str) -> object:
    """Validate ``key=raw_value`` against the run's schema (as ``ops.config set`` does) and write it;
    returns the value as stored. Raises ConfigError with the reason when it is refused."""
    value = ops_config.validate(run_dir, key, raw_value)
    await ops_config.put_value(bus, key, value)
    log.info("dashboard_config_set", key=key, value=value)
    return value


async def feed_live(bus: Bus, view: RunView, sample_s: float) -> None:
    """All live feeds into ``view`` until cancelled; one failing feed ends them all, with its error."""
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(follow_events(bus, view), name="dashboard-events")
        tasks.create_task(watch_config(bus, view), name="dashboard-config")
        tasks.create_task(sample_status(bus, view, sample_s), name="dashboard-status")
