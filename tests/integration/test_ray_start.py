"""A Ray cluster started as the cluster guide starts one (a real ``ray start --head``, Ray's token
authentication on, as a head turns it on where a token exists), and what runtime.up says when it may not join
it or when a node cannot reach the run's store: one error naming the cause and the setting, before any actor
starts, with the run's bus and store left free so that the same command works once the cause is fixed.

The head runs without S3 credentials (a node set up without them); runtime.up has them (moto's S3 server).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import boto3
import pytest

from runtime.blob import open_store
from runtime.blob.testing import MotoServer
from runtime.bus import Bus
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.run_state import RECORD_BLOB, read_run_record
from tests.integration.harness import REPO, LiveRun, run_events, write_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("ray_start_head")]  # one worker: one head

RUN = """
[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = 1
heartbeat_s = 1.0
[actors.counter.placement]
resources = {sandbox = 1}
"""
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, str]]:
    """``ray start --head --block`` with token authentication and no S3 credentials: (its address, its token);
    its whole process group killed at the end."""
    token, port = os.urandom(16).hex(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    head = subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--num-cpus=2", '--resources={"sandbox": 4}',
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}", "--block"],
                            env=env, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:  # the GCS's port answers once the head is up (each try is itself bounded)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, f"ray start --head: {head.returncode}"
                time.sleep(0.2)
        yield f"127.0.0.1:{port}", token
    finally:
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(60)
        with contextlib.suppress(ProcessLookupError):  # whatever of its group is left
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
async def bus_url(tmp_path: Path) -> AsyncIterator[str]:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        yield server.url


async def _up(run_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "runtime.up", "--quiet", "--run-dir",
                                                    str(run_dir), *args], cwd=REPO, capture_output=True, text=True,
                                   timeout=300, check=False)
    return done, time.monotonic() - started


async def _bus_is_free(url: str) -> bool:
    bus = await Bus.connect(url, name="test")
    try:
        return await read_run_record(bus) is None
    finally:
        await bus.close()


async def test_a_head_with_token_authentication_is_named_and_the_refused_start_claims_nothing(
        tmp_path: Path, ray_head: tuple[str, str], bus_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    address, token = ray_head
    storage = (tmp_path / "storage").as_uri()
    args = ("--config", str(write_config(tmp_path / "run.toml", RUN)), "--set", 'runtime.backend="ray"',
            "--set", f'runtime.ray_address="{address}"', "--set", f"bus.url={bus_url}",
            "--set", f"storage.url={storage}")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    refused, took = await _up(tmp_path / "a", *args)
    assert refused.returncode == 2, refused.stderr
    message = refused.stderr
    assert "requires token authentication" in message and "RAY_AUTH_MODE=(unset)" in message, message
    assert "set RAY_AUTH_MODE=token" in message and "for runtime.up and for `ray start` on every node" in message
    assert "fix runtime.ray_address" not in message and "Traceback" not in message, message
    assert took < 30, f"{took:.1f}s: named at once, not after ray.init's 20 s of retries"

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 32)  # not the head's
    wrong, _ = await _up(tmp_path / "b", *args)
    assert wrong.returncode == 2 and "refused this runtime.up's token" in wrong.stderr, wrong.stderr

    # neither start claimed the bus or the store: the same command, with the head's token, starts the run
    assert await _bus_is_free(bus_url)
    async with open_store(storage) as store:
        assert not await store.exists(RECORD_BLOB)
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    run = await LiveRun(tmp_path / "c", [], *args).start(timeout_s=180)
    try:
        await run.wait_actors("counter", 1, timeout_s=180)
    finally:
        assert await run.stop(timeout_s=120) == 0


async def test_a_node_without_s3_credentials_fails_the_start_once_naming_the_node_and_the_setting(
        tmp_path: Path, ray_head: tuple[str, str], bus_url: str, moto: MotoServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    address, token = ray_head
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("RAY_AUTH_MODE", "token"), ("RAY_AUTH_TOKEN", token)):
        monkeypatch.setenv(name, value)  # runtime.up has them; the head node has no S3 credentials
    boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="runs")
    storage = "s3://runs/node-check"
    refused, took = await _up(
        tmp_path / "a", "--config", str(write_config(tmp_path / "run.toml", RUN)), "--set", 'runtime.backend="ray"',
        "--set", f'runtime.ray_address="{address}"', "--set", f"bus.url={bus_url}", "--set", f"storage.url={storage}",
        "--set", f"storage.s3_endpoint={moto.endpoint}")
    assert refused.returncode == 2, refused.stderr
    message = refused.stderr
    assert "cannot be reached from every Ray node" in message and f"({socket.gethostname()})" in message, message
    assert "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message, message
    assert "Traceback" not in message and len(message.strip().splitlines()) == 1, message
    assert took < 90, took
    assert run_events(tmp_path / "a", "actor_starting") == [], "refused before any actor started"
    assert await _bus_is_free(bus_url)
    async with open_store(storage, s3_endpoint=moto.endpoint) as store:
        assert await store.list() == []


HOLD_SANDBOXES = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
holder = ray.remote(num_cpus=0, resources={"sandbox": 4})(type("Holder", (), {"ready": lambda self: True})).remote()
ray.get(holder.ready.remote())
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


async def test_a_run_that_fails_before_any_actor_process_started_leaves_bus_and_store_free(
        tmp_path: Path, ray_head: tuple[str, str], bus_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster can hold the run (a node has `sandbox`), but another job holds every `sandbox` now: each
    start times out, the restart limit fails the run, and nothing of it ever ran."""
    address, token = ray_head
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    holder = subprocess.Popen(  # noqa: ASYNC220 - a plain Popen whose stdin the test closes
        [sys.executable, "-c", HOLD_SANDBOXES, address], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    storage = (tmp_path / "storage").as_uri()
    args = ("--config", str(write_config(tmp_path / "run.toml", RUN)), "--set", 'runtime.backend="ray"',
            "--set", f'runtime.ray_address="{address}"', "--set", f"bus.url={bus_url}",
            "--set", f"storage.url={storage}", "--set", "runtime.ray_place_timeout_s=2",
            "--set", "supervisor.max_restarts=1", "--set", "supervisor.backoff_base_s=0.1")
    try:
        assert holder.stdout is not None
        held = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 120)
        assert held.strip() == "held", held
        failed, _ = await _up(tmp_path / "a", *args)
        assert failed.returncode == 1 and "not started within 2.0s" in failed.stderr, failed.stderr
    finally:
        holder.communicate(timeout=60)  # its stdin closed: it ends, and Ray frees the sandboxes
    assert run_events(tmp_path / "a", "actor_spawned") and run_events(tmp_path / "a", "run_withdrawn")
    assert await _bus_is_free(bus_url)
    async with open_store(storage) as store:
        assert not await store.exists(RECORD_BLOB)
    run = await LiveRun(tmp_path / "b", [], *args).start(timeout_s=180)  # the same command, the sandboxes free
    try:
        await run.wait_actors("counter", 1, timeout_s=180)
    finally:
        assert await run.stop(timeout_s=120) == 0

