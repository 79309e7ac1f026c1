"""A dashboard drained (SIGTERM) right as it starts serving stops within its drain bound, start after start.

As it starts, its feeds open their watches: the run's event log followed from its beginning (read in batches,
each record one nats-py wait), the live configuration watched. A drain that met one of those waits as it
completed was swallowed there (Python 3.11's ``asyncio.wait_for`` in nats-py; `runtime.cancellation`), and the feed
went on following the log or waiting for a configuration change: the process never ended (its supervisor would
kill it after the drain timeout). A log of some thousand lines makes the opening long enough for the drain to
meet it; the supervisor restarts each drained process (an exit it did not ask for), so one run gives every start.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from runtime.bus import Bus
from runtime.registry import decode_registration
from tests.integration.harness import LiveRun, alive, write_config
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

NUM_STARTS = 5
NUM_LOG_LINES = 20000  # the event log a dashboard reads as it starts: some eighty batches of direct gets
DRAIN_S = 20.0  # the dashboard's drain bound (its drain_timeout_s): a drained one that outlives it hangs

RUN = f"""
[supervisor]
max_restarts = 50
backoff_base_s = 0.1
backoff_max_s = 0.5

[dashboard]
port = 0

[actors.dashboard]
entry = "ops.dashboard.actor:DashboardActor"
drain_timeout_s = {DRAIN_S}
"""


async def _fill_log(bus: Bus, num_lines: int) -> None:
    for i in range(num_lines):
        line = json.dumps({"event": "filler", "n": i, "level": "info", "kind": "test",
                           "time": "2026-01-01T00:00:00+00:00"})
        await bus.publish("log.test.info", line.encode())
    await bus.flush(timeout_s=10)


async def _next_running(bus: Bus, seen: set[str], timeout_s: float) -> dict[str, Any]:
    """The registry entry of the first dashboard not in ``seen`` to say it is running, the moment it does."""
    async with asyncio.timeout(timeout_s):
        async for entry in bus.kv_watch("actors", "reg.dashboard.*"):
            if entry is None or entry.deleted or not entry.value:
                continue
            info = decode_registration(entry.key, entry.value)
            if info.get("state") == "running" and info["id"] not in seen:
                return info
    raise AssertionError("unreachable: a watch ends only by its timeout")


async def test_a_dashboard_drained_as_it_starts_stops_within_its_drain_bound(tmp_path: Path) -> None:
    run = await LiveRun(tmp_path / "run", write_config(tmp_path / "run.toml", RUN)).start()
    try:
        assert run.bus is not None
        await _fill_log(run.bus, NUM_LOG_LINES)
        seen: set[str] = set()
        took: list[float] = []
        for start in range(1, NUM_STARTS + 1):
            dashboard = await _next_running(run.bus, seen, timeout_s=120)
            seen.add(dashboard["id"])
            os.kill(dashboard["pid"], signal.SIGTERM)  # a drain, as the supervisor's stop sends when not answered
            began = time.monotonic()
            try:
                await until(lambda pid=dashboard["pid"]: not alive(pid), DRAIN_S, "the drained dashboard's exit")
            except AssertionError:
                raise AssertionError(f"start {start}: {dashboard['id']} drained as it started is still running "
                                     f"{DRAIN_S}s later; where the run stands:\n{run.where_it_stands()}") from None
            took.append(round(time.monotonic() - began, 2))
        print(f"drained at start, seconds to stop: {took}")
    finally:
        await run.stop()
