"""The README's ten-minute tour followed as written: every block marked runnable in README.md (`runnable_blocks`) is
run as it stands, from the repository's root, against one short run (``--preset short``).

The marks and their kinds: tests/docs/runnable.py.

- The run (``<!-- runnable: background -->``) starts first; the followers start as soon as it has printed its run
  directory, the other commands of the tour once it prints its progress line, while it trains.
- The environment block names ``RUN_DIR``; the test gives it the directory the run printed, and runs no other
  setting.
- The followers (``ops.tail``, a background block) run beside the run and must end by themselves when it stops,
  exit 0, with its outcome; ``ops.status``, ``ops.config`` (the refused set included) and ``ops.swap`` run to
  completion and must succeed.
- The run is stopped with Ctrl-C (SIGINT) once those commands are done, as its operator would, and must exit 0
  before its last step; the dashboard of the stopped run (a background block) then serves its page from the
  files; the resume trains the steps left and finishes, exit 0, each step trained and reported once.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from actors.__main__ import PRESETS_DIR
from runtime.blob import open_store
from runtime.metrics_log import read_metrics
from runtime.run_config import load_run_config
from runtime.rundir import RunInfo
from tests.docs.runnable import Block, runnable_blocks
from tests.integration.harness import REPO, Machine
from tests.waiting import until

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

README = REPO / "README.md"
FOLLOWERS = 3


def test_the_readmes_runnable_blocks_are_the_steps_this_test_takes() -> None:
    """The shape of the tour this test runs: a change to it that the test does not follow fails here, at once."""
    blocks = runnable_blocks(README)
    assert [b.kind for b in blocks] == ["background", "environment", "run", "background", "background", "run",
                                        "run", "run"], blocks
    run, environment, status, dashboard, followers, config, swap, resume = blocks
    assert [c.split()[:5] for c in run.commands] == [[".venv/bin/python", "-m", "actors", "--preset", "short"]]
    assert set(environment.exported()) == {"RUN_DIR"}
    assert [c.split()[2] for c in status.commands] == ["ops.status"]
    assert [c.split()[2] for c in dashboard.commands] == ["ops.dashboard"]
    assert [c.split()[2] for c in followers.commands] == ["ops.tail"] * FOLLOWERS
    assert [c.split()[2:4] for c in config.commands] == [["ops.config", "list"]] + [["ops.config", "get"]] + \
                                                        [["ops.config", "set"]] * 2
    assert [c.split()[2:4] for c in swap.commands] == [["ops.swap", "reward"]]
    assert [c.split()[2:4] for c in resume.commands] == [["actors", "--resume"]]
    assert (PRESETS_DIR / "short.toml").is_file(), "the tour's preset is shipped"


def _run_block(block: Block, env: dict[str, str], timeout_s: float) -> str:
    """The block as one bash script from the repository's root; its stdout and stderr, once it has succeeded."""
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{README.name} line {block.line} exited {done.returncode}:\n{output[-3000:]}"
    return output


async def _trained_versions(run_dir: Path) -> list[int]:
    info = RunInfo.read(run_dir)
    async with open_store(info.storage_url) as store:
        return [row["version"] for row in await read_metrics(store, kind="train")]


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status


async def test_the_readme_tour_as_written(tmp_path: Path) -> None:
    run_block, environment, status, dashboard, followers, config, swap, resume = runnable_blocks(README)
    steps_given = re.search(r"--steps (\d+)", run_block.commands[0])  # enough steps left after the tour's commands
    steps = int(steps_given[1]) if steps_given else load_run_config(
        [REPO / "actors" / "run.toml", PRESETS_DIR / "short.toml"]).runtime.run.steps
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    machine = Machine(tmp_path, [])
    run_dir: Path | None = None
    started = time.monotonic()
    try:
        run = machine.start(run_block.commands[0], env, REPO, "run")

        def printed_run_dir() -> str | None:
            assert run.poll() is None, machine.output("run")[-3000:]
            found = re.search(r"started run  \S+  in (\S+)", machine.output("run"))
            return found[1] if found else None

        env["RUN_DIR"] = await until(printed_run_dir, 300, "the run's directory printed at its start")
        assert set(environment.exported()) == {"RUN_DIR"}, "the test sets exactly the variables the README names"
        run_dir = Path(env["RUN_DIR"])
        up_s = time.monotonic() - started
        tails = [machine.start(command, env, REPO, f"tail-{i}") for i, command in enumerate(followers.commands)]


        def progress() -> bool:  # the run's actors are up: the progress line names the dashboard's address
            assert run.poll() is None, machine.output("run")[-3000:]
            return "dashboard=http" in machine.output("run")

        await until(progress, 300, "the run's first progress line")
        output = await asyncio.to_thread(_run_block, status, env, 60)
        assert "actors:" in output, output
        output = await asyncio.to_thread(_run_block, config, env, 120)
        assert "rollout.temperature = 0.7" in output, output
        assert "refused: exit 2" in output and "reward.length_coef" in output, output
        output = await asyncio.to_thread(_run_block, swap, env, 300)
        assert '"ok": true' in output, output
        tour_s = time.monotonic() - started

        assert run.poll() is None, f"the run ended before its Ctrl-C:\n{machine.output('run')[-3000:]}"
        run.send_signal(signal.SIGINT)  # Ctrl-C: every actor drains, the run stops
        assert await asyncio.to_thread(run.wait, 300) == 0, machine.output("run")[-3000:]
        assert "run stopped" in machine.output("run"), machine.output("run")[-3000:]
        stopped_at = len(await _trained_versions(run_dir))
        assert stopped_at < steps, f"the run was stopped after its last step ({stopped_at}): nothing to resume"
        for i, tail in enumerate(tails):  # a follower ends by itself when the run does, with its outcome
            assert await asyncio.to_thread(tail.wait, 60) == 0, machine.output(f"tail-{i}")[-3000:]
            assert f"ops.tail: run {run_dir} stopped" in machine.output(f"tail-{i}"), machine.output(f"tail-{i}")
        assert '"event": "actor_' in machine.output(f"tail-{FOLLOWERS - 1}"), "jq's lines of the actor_* events"

        page = machine.start(dashboard.commands[0], env, REPO, "dashboard")

        def dashboard_address() -> str | None:
            assert page.poll() is None, machine.output("dashboard")[-3000:]
            found = re.search(r"^dashboard  (http://\S+)", machine.output("dashboard"), re.MULTILINE)
            return found[1] if found else None

        address = await until(dashboard_address, 60, "the dashboard's address")
        assert await asyncio.to_thread(_get, address) == 200

        resumed_at = time.monotonic()
        output = await asyncio.to_thread(_run_block, resume, env, 900)
        assert f"resumed run  {run_dir.name}" in output and "run finished" in output, output[-3000:]
        print(f"the README tour: the run up {up_s:.0f}s after its start, the tour's commands done at {tour_s:.0f}s, "
              f"stopped after step {stopped_at}; the resume ran {time.monotonic() - resumed_at:.0f}s; "
              f"{time.monotonic() - started:.0f}s in all")
        assert await _trained_versions(run_dir) == list(range(1, steps + 1)), "each step trained and reported once"
    finally:
        machine.stop()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
