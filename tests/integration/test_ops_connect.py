"""An ops command reaches the bus of its own run or none: a server now at a finished run's address that
carries another run (its port taken by a later run on the machine) or no run is refused, and the command
reads the run's files instead."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops._client import connect
from runtime.bus import Bus
from runtime.errors import BusError
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.run_state import RECORD_KEY, RUN_BUCKET, RunRecord
from runtime.rundir import RunInfo
from tests.integration.harness import REPO

pytestmark = pytest.mark.timeout(120)


def _run_dir(tmp_path: Path, url: str, run_id: str) -> Path:
    run_dir = tmp_path / run_id
    (run_dir / "logs").mkdir(parents=True)
    RunInfo(str(run_dir), url, (tmp_path / "blobs").as_uri(), "", 1, time.time(), run_id=run_id).write()
    (run_dir / "logs" / "trainer-1.jsonl").write_text('{"event": "step_trained", "level": "info"}\n')
    return run_dir


async def test_a_bus_carrying_another_run_or_none_is_refused_and_its_own_is_taken(tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        url = server.url
        bus = await Bus.connect(url, name="test")
        await bus.ensure_base()
        mine = _run_dir(tmp_path, url, "run-a")
        with pytest.raises(BusError, match="carries no run, not run 'run-a'"):
            await connect(mine, "test")
        await bus.kv_create(RUN_BUCKET, RECORD_KEY, RunRecord("run-b", "b", "file:///x", "", time.time()).to_bytes())
        with pytest.raises(BusError, match="carries run 'run-b', not run 'run-a'"):
            await connect(mine, "test")
        own = await connect(_run_dir(tmp_path, url, "run-b"), "test")
        await own.close()

        # the tail, offline, says so and reads the files instead of following another run's events
        tail = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "ops.tail", str(mine), "--json"],
                                       cwd=REPO, capture_output=True, text=True, timeout=60)
        await bus.close()
        assert tail.returncode == 0, tail.stderr
        assert "carries run 'run-b'" in tail.stderr and "step_trained" in tail.stdout
