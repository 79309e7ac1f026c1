"""``python -m ops.status`` on a live run: the real reconciler with simulated stages, before and after
the reconciler is killed with SIGKILL (its registry entry then lingers, and status must not hang on it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import REPO, LiveRun, write_config
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
NUM_SLOTS, GROUP_SIZE, BATCH_GROUPS, ETA = 48, 4, 4, 1


def status(run: LiveRun, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ops.status", str(run.run_dir), *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def check_lifecycle(rec: dict[str, Any]) -> None:
    lc = rec["lifecycle"]
    assert sum(lc["slots_per_state"].values()) == NUM_SLOTS
    assert set(lc["slots_per_state"]) == {"empty", "rollout", "reward", "group", "ready", "train", "failed"}
    assert {"rollout", "reward", "group", "train"} <= set(lc["stage_latency"]), lc["stage_latency"]
    for stage, latency in lc["stage_latency"].items():
        assert 0 < latency["p50_s"] <= latency["p99_s"] and latency["count"] > 0, (stage, latency)
    assert lc["admissions"]["admitted"] > 0
    assert lc["lag_histogram"] and all(0 <= int(lag) <= ETA for lag in lc["lag_histogram"]), lc["lag_histogram"]
    assert lc["samples_per_s"] > 0 and lc["groups_per_s"] > 0
    assert lc["samples_per_s"] >= lc["groups_per_s"]


async def test_status_of_a_live_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    SimConfig(
        rollout=StageSim(median_s=0.15, sigma=1.0, max_s=1.5),
        train=StageSim(median_s=0.3, sigma=0.3, max_s=1.0),
    ).write(run_dir)
    text = sim_run_toml(num_prompts=400, num_slots=NUM_SLOTS, group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS, eta=ETA)
    run = await LiveRun(run_dir, write_config(tmp_path / "run.toml", text)).start()
    try:
        assert run.bus is not None
        ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))

        async def trained(num: int) -> bool:
            return await ledger.version() >= num

        await until(lambda: trained(3), 90, "three trained batches", every_s=0.5)
        raw = json.loads(status(run, "--json"))
        check_lifecycle(raw["reconciler"])
        assert raw["trainer"]["version"] >= 3
        assert {a["kind"] for a in raw["actors"]} == {"reconciler", "rollout", "reward", "grouping", "trainer"}
        shown = status(run)
        for line in ("slots ", "latency ", "admission ", "lag ", "throughput "):
            assert f"  {line}" in shown, shown
        assert "rollout p50=" in shown and "samples/s" in shown

        (old,) = [a for a in raw["actors"] if a["kind"] == "reconciler"]
        os.kill(old["pid"], signal.SIGKILL)
        version = await ledger.version()
        await until(lambda: trained(version + 2), 90, "two batches trained by the restarted reconciler", every_s=0.5)
        raw = json.loads(status(run, "--json"))
        # The supervisor unregisters a process that died without stopping; status shows its successor.
        assert old["id"] not in {a["id"] for a in raw["actors"]}, "the killed reconciler is no longer listed"
        (new,) = [a for a in raw["actors"] if a["kind"] == "reconciler"]
        assert new["pid"] != old["pid"] and new.get("live", True)
        check_lifecycle(raw["reconciler"])
    finally:
        assert await run.stop() == 0
