"""``python -m ops.dashboard RUN_DIR`` on a run that ended (issue 30, item 10): served from its files at once, its bus
not asked (no connection attempt, no warning about one), and the page told how it ended ("finished", not "live").

How a run ended is its supervisor's word in its event file (``supervisor_stopped``), for the latest start from that
directory (run.json's ``started_at``): a stop before it is an earlier start's, and a run killed without a word is
tried live as before."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from ops.dashboard.feeds import run_end
from runtime.rundir import SUPERVISOR_LOG, RunInfo

REPO = Path(__file__).resolve().parents[2]


def _at(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _run_dir(tmp_path: Path, nats_url: str, started_at: float, stops: dict[float, str]) -> Path:
    """A run directory as runtime.up leaves it: run.json, config.toml, the supervisor's events (``stops``: time ->
    outcome of each ``supervisor_stopped``) and a trainer's step."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    RunInfo(str(run_dir), nats_url, (run_dir / "blobs").as_uri(), "", 1, started_at, run_id="r-1").write()
    (run_dir / "config.toml").write_text("")
    events = [{"time": _at(started_at), "level": "info", "event": "actor_spawned", "kind": "supervisor"}]
    events += [{"time": _at(t), "level": "info", "event": "supervisor_stopped", "outcome": outcome,
                "kind": "supervisor"} for t, outcome in sorted(stops.items())]
    (run_dir / SUPERVISOR_LOG).write_text("".join(json.dumps(e) + "\n" for e in events))
    step = {"time": _at(started_at + 1), "level": "info", "event": "train_step", "kind": "trainer", "version": 1,
            "reward_mean": 0.5}
    (run_dir / "logs" / "trainer-1-ab.jsonl").write_text(json.dumps(step) + "\n")
    return run_dir


def test_how_the_latest_start_ended_is_its_supervisor_s_last_word(tmp_path: Path) -> None:
    now = time.time()
    ended = run_end(_run_dir(tmp_path / "a", "nats://127.0.0.1:1", now - 10, {now - 5: "finished"}), now - 10)
    assert ended is not None and ended.outcome == "finished" and abs(ended.at.timestamp() - (now - 5)) < 1e-3
    resumed = _run_dir(tmp_path / "b", "nats://127.0.0.1:1", now - 10, {now - 20: "stopped"})
    assert run_end(resumed, now - 10) is None, "an earlier start's stop: resumed here since"
    assert run_end(_run_dir(tmp_path / "c", "nats://127.0.0.1:1", now - 10, {}), now - 10) is None, "killed, or live"
    assert run_end(tmp_path / "nothing", now) is None


async def test_a_finished_run_is_served_from_its_files_as_finished_without_asking_its_bus(tmp_path: Path) -> None:
    attempts: list[int] = []

    async def bus_address(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attempts.append(1)  # a NATS client waits for the server's INFO: none comes, as from a stopped run
        writer.close()

    listener = await asyncio.start_server(bus_address, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    now = time.time()
    run_dir = _run_dir(tmp_path, f"nats://127.0.0.1:{port}", now - 10, {now - 1: "finished"})
    served = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ops.dashboard", str(run_dir), "--port", "0", cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert served.stdout is not None
        line = (await asyncio.wait_for(served.stdout.readline(), 30)).decode()
        assert line.startswith("dashboard  http://"), line
        async with aiohttp.ClientSession() as http, http.get(line.split()[1] + "api/snapshot") as response:
            snapshot = await response.json()
    finally:
        served.terminate()
        _, stderr = await served.communicate()
        listener.close()
    assert attempts == [], "the bus of a run that ended is not asked"
    said = stderr.decode().splitlines()
    assert len(said) == 1 and "run r-1 finished at" in said[0] and "not answer" not in said[0], said
    assert (snapshot.get("live"), snapshot.get("ended")) == (False, "finished"), "the page's badge says how it ended"
    assert [r["version"] for r in snapshot["train"]] == [1], "from its files"
