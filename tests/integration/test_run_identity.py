"""A run's identity on its bus and in its store: one bus carries one run, one runtime.up at a time runs it,
and a resume by id or an actor process finds the run from the bus address and the id alone, or says why not."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runtime.blob import open_store
from runtime.blob.testing import MotoServer
from runtime.bus import Bus
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.run_state import CONFIG_BLOB, RECORD_BLOB, RUN_BUCKET, RunRecord, read_run_record
from tests.integration.harness import REPO, LiveRun, run_events, write_config

pytestmark = pytest.mark.timeout(240)

RUN = """
[run]
name = "identity"
[supervisor]
lease_s = 2.0
[actors.counter]
entry = "tests.integration.workers:CounterActor"
heartbeat_s = 1.0
"""


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """A bus and a store of the run's own (nothing of them in any run directory)."""
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        yield server.url, (tmp_path / "storage").as_uri()


async def _run(*args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                                   text=True, timeout=timeout_s, check=False)


async def _up(*args: str) -> subprocess.CompletedProcess[str]:
    return await _run("runtime.up", "--quiet", *args)


async def test_the_run_is_on_its_bus_and_in_its_store_and_a_second_runtime_up_is_refused(
        tmp_path: Path, cluster: tuple[str, str]) -> None:
    url, storage = cluster
    where = ("--set", f"bus.url={url}", "--set", f"storage.url={storage}")
    run = await LiveRun(tmp_path / "a", write_config(tmp_path / "run.toml", RUN), *where).start()
    try:
        assert run.bus is not None and run.info is not None
        run_id = run.info.run
        assert run_id.startswith(time.strftime("%Y")) and "-identity-" in run_id and run_id != run.run_dir.name
        record = await read_run_record(run.bus)
        assert record is not None and record.run_id == run_id and record.storage_url == storage
        async with open_store(storage) as store:
            assert RunRecord.from_bytes(await store.get(RECORD_BLOB), "store").run_id == run_id
            assert 'entry = "tests.integration.workers:CounterActor"' in (await store.get(CONFIG_BLOB)).decode()
        await run.wait_actors("counter", 1)

        started = time.monotonic()
        second = await _up("--resume", run_id, "--run-dir", str(tmp_path / "b"), *where)
        took = time.monotonic() - started
        assert second.returncode == 2, second.stderr
        assert "being run by another runtime.up" in second.stderr and str(run.run_dir) in second.stderr
        assert took < 60, took
        assert run.proc is not None and run.proc.poll() is None, "the live run goes on"

        # an operator on another machine: attached from the bus alone, every ops command takes the folder
        attached = await _run("ops.attach", run_id, "--set", f"bus.url={url}", "--run-dir", str(tmp_path / "ops"))
        assert attached.returncode == 0, attached.stderr
        status = await _run("ops.status", str(tmp_path / "ops"), "--json")
        assert status.returncode == 0 and '"counter' in status.stdout, status.stderr
        stray = await _run("ops.attach", "someone-else", "--set", f"bus.url={url}", "--run-dir", str(tmp_path / "x"))
        assert stray.returncode == 2 and f"carries run '{run_id}', not 'someone-else'" in stray.stderr
    finally:
        assert await run.stop() == 0

    # stopped cleanly: its lease is released, and a new run on the same store or the same bus is refused
    other = await _up("--config", str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "c"), *where)
    assert other.returncode == 2 and f"holds run '{run_id}', not" in other.stderr, other.stderr
    other = await _up("--config", str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "d"), "--set",
                      f"bus.url={url}", "--set", f"storage.url={(tmp_path / 'other-storage').as_uri()}")
    assert other.returncode == 2 and f"already carries run '{run_id}'" in other.stderr, other.stderr
    assert "python -m ops.clear" in other.stderr, other.stderr
    async with open_store((tmp_path / "other-storage").as_uri()) as store:  # refused, so nothing claimed
        assert await store.list() == []


async def test_a_bus_that_carried_an_ended_run_is_cleared_for_a_new_one_and_its_store_kept(
        tmp_path: Path, cluster: tuple[str, str]) -> None:
    """The documented way to start run after run on one bus: ``ops.clear`` once the run has ended (refused
    while it runs, and for a run the bus does not carry), and a storage URL that each run's id fills in."""
    url, _ = cluster
    storage = (tmp_path / "storage").as_uri() + "/{run_id}"
    where = ("--set", f"bus.url={url}", "--set", f"storage.url={storage}")
    config = write_config(tmp_path / "run.toml", RUN)
    first = await LiveRun(tmp_path / "a", config, *where).start()
    try:
        assert first.info is not None
        run_id = first.info.run
        assert first.info.storage_url == (tmp_path / "storage" / run_id).as_uri()
        await first.wait_actors("counter", 1)
        live = await _run("ops.clear", run_id, "--set", f"bus.url={url}")
        assert live.returncode == 2 and "stop it first" in live.stderr, live.stderr
    finally:
        assert await first.stop() == 0
    stray = await _run("ops.clear", "someone-else", "--set", f"bus.url={url}")
    assert stray.returncode == 2 and f"carries run '{run_id}', not 'someone-else'" in stray.stderr, stray.stderr

    cleared = await _run("ops.clear", run_id, "--set", f"bus.url={url}")
    assert cleared.returncode == 0 and "KV_run" in cleared.stdout, cleared.stderr
    second = await LiveRun(tmp_path / "b", config, *where).start()  # the same command as the first run's
    try:
        assert second.info is not None and second.bus is not None and second.info.run != run_id
        await second.wait_actors("counter", 1)
        record = await read_run_record(second.bus)
        assert record is not None and record.run_id == second.info.run
    finally:
        assert await second.stop() == 0
    async with open_store((tmp_path / "storage" / run_id).as_uri()) as kept:  # the cleared run's store is kept
        assert RunRecord.from_bytes(await kept.get(RECORD_BLOB), "store").run_id == run_id


async def test_a_resume_by_id_and_an_actor_process_say_why_they_find_no_run(
        tmp_path: Path, cluster: tuple[str, str]) -> None:
    url, storage = cluster
    no_bus = await _up("--resume", "20260101-000000-x-abcdef")
    assert no_bus.returncode == 2 and "needs the bus that carries it" in no_bus.stderr, no_bus.stderr
    empty = await _up("--resume", "20260101-000000-x-abcdef", "--set", f"bus.url={url}",
                      "--run-dir", str(tmp_path / "x"))
    assert empty.returncode == 2 and "carries no run" in empty.stderr, empty.stderr
    bad_id = await _up("--resume", "no/such run", "--set", f"bus.url={url}")
    assert bad_id.returncode == 2 and "must be 1-128 letters" in bad_id.stderr, bad_id.stderr

    where = ("--set", f"bus.url={url}", "--set", f"storage.url={storage}")
    run = await LiveRun(tmp_path / "a", write_config(tmp_path / "run.toml", RUN), *where).start()
    try:
        assert run.info is not None
        stray = await _run("runtime.actor_process", "--bus", url, "--run", "someone-else", "--kind", "counter",
                           "--id", "counter-9-0000", "--run-dir", str(tmp_path / "stray"))
        assert stray.returncode != 0 and f"carries run '{run.info.run}', not run 'someone-else'" in stray.stderr
        wrong_kind = await _run("runtime.actor_process", "--bus", url, "--run", run.info.run, "--kind", "nope",
                                "--id", "nope-1-0000", "--run-dir", str(tmp_path / "stray"))
        assert wrong_kind.returncode != 0 and "has no actor kind 'nope'" in wrong_kind.stderr
    finally:
        assert await run.stop() == 0
    assert run_events(run.run_dir, "actor_crashed") == []


async def test_a_resume_after_runtime_up_was_killed_takes_its_lapsed_lease_over(
        tmp_path: Path, cluster: tuple[str, str]) -> None:
    url, storage = cluster
    where = ("--set", f"bus.url={url}", "--set", f"storage.url={storage}")
    first = await LiveRun(tmp_path / "a", write_config(tmp_path / "run.toml", RUN), *where).start()
    try:
        assert first.info is not None and first.proc is not None
        await first.wait_actors("counter", 1)
        first.proc.kill()
        first.proc.wait(10)
    finally:
        await first.stop()
    second = await LiveRun(tmp_path / "b", [], "--resume", first.info.run, *where).start(timeout_s=60)
    try:
        assert second.bus is not None
        await second.wait_actors("counter", 1)
        lease = await second.bus.kv_get(RUN_BUCKET, "supervisor")
        assert lease is not None and str(second.run_dir) in lease.value.decode()
    finally:
        assert await second.stop() == 0
    (taken,) = run_events(second.run_dir, "lease_taken_over")
    assert str(first.run_dir) in taken["lapsed_holder"]


async def test_a_start_without_s3_credentials_is_one_configuration_error_that_claims_nothing(
        tmp_path: Path, cluster: tuple[str, str], moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = cluster
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find on a test machine
    storage = "s3://runs/no-credentials"
    refused = await _up("--config", str(write_config(tmp_path / "run.toml", RUN)), "--run-dir", str(tmp_path / "a"),
                        "--set", f"bus.url={url}", "--set", f"storage.url={storage}",
                        "--set", f"storage.s3_endpoint={moto.endpoint}")
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"configuration error: storage.url={storage} cannot be reached from runtime.up"), line
    assert "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line, line
    assert "every actor process needs the same on its node" in line, line
    assert run_events(tmp_path / "a", "actor_starting") == []
    bus = await Bus.connect(url, name="test")
    try:
        assert await read_run_record(bus) is None
    finally:
        await bus.close()

