"""The cluster guide (docs/cluster.md, "A cluster, step by step") followed as written, one machine standing in for
all of them: every block marked runnable on the page (`runnable_blocks`) is run as it stands, in order.

The marks and their kinds: tests/docs/runnable.py.

- The first block (``<!-- runnable: environment -->``) names the variables the others use; the test gives the same
  variables its own values (free loopback ports, directories under the test's, a bucket of moto's S3 server,
  a Ray token of its own), the one thing that differs on a test machine, and runs no other setting.
- A ``<!-- runnable -->`` block runs as one bash script, which must succeed: the bus recipe, ``ray start`` of a head
  and a worker node (Ray's own processes in a temporary directory of the test's, ``RAY_TMPDIR``, and ended by
  their ids at the end), the resume.
- A ``<!-- runnable: background -->`` block's commands each keep running: the three nats-servers, the run. The run
  is stopped with Ctrl-C (SIGINT) after its first trained step, as its operator would, and must exit 0.

The resume runs from another directory with ``RUN_ID`` (the id the first run printed) and nothing of the first
run's directory; it trains the steps left and finishes by itself, exit 0. Each step is trained and reported once
(the run's metrics, read from the S3 bucket), no group twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from actors.__main__ import PRESETS_DIR
from runtime.blob import open_store
from runtime.blob.testing import MotoServer
from runtime.metrics_log import read_metrics
from runtime.natsserver import _free_loopback_ports
from runtime.run_config import load_run_config
from runtime.run_state import storage_url_of
from tests.docs.runnable import Block, runnable_blocks
from tests.integration.harness import REPO, Machine, alive
from tests.waiting import until

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

GUIDE = REPO / "docs" / "cluster.md"
def test_the_guides_runnable_blocks_are_the_steps_this_test_takes() -> None:
    """The shape of the page this test runs: a change to it that the test does not follow fails here, at once."""
    blocks = runnable_blocks(GUIDE)
    assert [b.kind for b in blocks] == ["environment", "run", "background", "run", "background", "run"], blocks
    _, recipe, servers, ray_nodes, first, resume = blocks
    assert [c.split()[:3] for c in recipe.commands] == [["python", "-m", "runtime.bus_recipe"]]
    assert [c.split()[0] for c in servers.commands] == ["nats-server"] * 3
    assert [c.split()[:2] for c in ray_nodes.commands] == [["ray", "start"]] * 2
    assert [c.split()[:4] for c in first.commands] == [["python", "-m", "actors", "--preset"]]
    assert "--resume" in resume.commands[0].split()
    assert (PRESETS_DIR / f"{first.commands[0].split()[4]}.toml").is_file(), "the guide's preset is shipped"


def _processes_under(directory: str) -> list[int]:
    """The processes whose command line names ``directory`` (Ray's, started by ``ray start`` with ``RAY_TMPDIR``
    there: they leave the shell that started them, so their ids are found, not kept)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if directory in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[str]:
    """A directory of this test's for Ray's sessions (short: Ray's socket paths must fit in 107 bytes); at the end,
    every process Ray started there is ended (SIGTERM, then SIGKILL), by id: never ``ray stop``, which ends every
    Ray process of the machine."""
    directory = tempfile.mkdtemp(prefix="ray-guide-", dir="/tmp")
    try:
        yield directory
    finally:
        pids = _processes_under(directory)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


def _run_block(block: Block, env: dict[str, str], cwd: Path, timeout_s: float) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, f"{GUIDE.name} line {block.line} exited {done.returncode}:\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"
    return done.stdout


async def _trained_rows(storage_url: str, s3_endpoint: str) -> list[dict]:
    async with open_store(storage_url, s3_endpoint=s3_endpoint) as store:
        return await read_metrics(store, kind="train")


def _guide_values(ports: list[int], tmp_path: Path, s3_endpoint: str) -> dict[str, str]:
    """This machine's values of the guide's variables: free loopback ports, directories of the test's, moto's S3."""
    return {
        "NATS_SERVERS": ",".join(f"127.0.0.1:{ports[i]}:{ports[i + 3]}" for i in range(3)),
        "BUS_URL": ",".join(f"nats://127.0.0.1:{port}" for port in ports[:3]),
        "NATS_STORE": str(tmp_path / "nats-store"), "ASYNCRL_ETC": str(tmp_path / "etc"),
        "RAY_PORT": str(ports[6]), "RAY_HEAD": f"127.0.0.1:{ports[6]}",
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(32).hex(),
        "STORAGE_URL": "s3://guide/runs/{run_id}", "S3_ENDPOINT": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "guide", "AWS_SECRET_ACCESS_KEY": "guide", "AWS_DEFAULT_REGION": "us-east-1",
    }


async def test_the_cluster_guide_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    environment, recipe, servers, ray_nodes, first_run, resume = runnable_blocks(GUIDE)
    started = time.monotonic()
    steps = load_run_config([REPO / "actors" / "run.toml", PRESETS_DIR / "short.toml"]).runtime.run.steps
    with MotoServer() as moto, ray_temp_dir() as ray_tmp:
        guide = _guide_values(_free_loopback_ports(7, "127.0.0.1"), tmp_path, moto.endpoint)
        assert set(environment.exported()) == set(guide), "the test sets exactly the variables the guide names"
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):  # this test reads the store
            monkeypatch.setenv(name, guide[name])
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1", aws_access_key_id="guide",
                     aws_secret_access_key="guide").create_bucket(Bucket="guide")
        env = {**os.environ, **guide, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        machine = Machine(tmp_path, [])
        try:
            _run_block(recipe, env, REPO, 120)
            for i, command in enumerate(servers.commands):
                machine.start(command, env, REPO, f"nats-{i + 1}")

            def cluster_formed() -> bool:
                logs = [machine.output(f"nats-{i + 1}") for i in range(len(servers.commands))]
                assert all(p.poll() is None for p in machine.processes), logs
                return all("Server is ready" in log for log in logs) and any("metadata leader" in log for log in logs)

            await until(cluster_formed, 60, "the three nats-servers of the recipe forming one JetStream cluster")
            await asyncio.to_thread(_run_block, ray_nodes, env, REPO, 180)

            machine_a, machine_b = tmp_path / "machine-a", tmp_path / "machine-b"
            machine_a.mkdir()
            machine_b.mkdir()
            run = machine.start(first_run.commands[0], env, machine_a, "first-run")

            def run_id() -> str | None:
                assert run.poll() is None, machine.output("first-run")[-3000:]
                found = re.search(r"started run  (\S+)", machine.output("first-run"))
                return found[1] if found else None

            env["RUN_ID"] = await until(run_id, 300, "the run's id printed at its start")
            store_url = storage_url_of(guide["STORAGE_URL"], env["RUN_ID"])

            def trained_a_step() -> bool:  # its progress line, the first moment it is said
                assert run.poll() is None, machine.output("first-run")[-3000:]
                return re.search(r"\bstep=1\b", machine.output("first-run")) is not None

            await until(trained_a_step, 900, "a first trained step", every_s=0.2)
            first_step_s = time.monotonic() - started
            run.send_signal(signal.SIGINT)  # Ctrl-C: every actor drains, the run stops
            assert await asyncio.to_thread(run.wait, 300) == 0, machine.output("first-run")[-3000:]
            stopped_at = len(await _trained_rows(store_url, moto.endpoint))
            assert stopped_at < steps, f"the run was stopped after its last step ({stopped_at}): nothing to resume"

            resumed_at = time.monotonic()
            output = await asyncio.to_thread(_run_block, resume, env, machine_b, 1200)
            print(f"the guide: a first trained step {first_step_s:.0f}s after the recipe, stopped after step "
                  f"{stopped_at}; the resume ran {time.monotonic() - resumed_at:.0f}s; "
                  f"{time.monotonic() - started:.0f}s in all")
            assert f"resumed run  {env['RUN_ID']}" in output
            rows = await _trained_rows(store_url, moto.endpoint)
        finally:
            machine.stop()
    assert [r["version"] for r in rows] == list(range(1, steps + 1)), "each step trained and reported once"
    groups = [g for r in rows for g in r["group_ids"]]
    assert len(groups) == len(set(groups)), f"no group trained twice: {groups}"
