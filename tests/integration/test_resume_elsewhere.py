"""Chaos: the process running ``runtime.up`` killed (-9) mid-run, and the run resumed from a fresh directory.

The run's bus is a nats-server of its own (with a user per role: the credentials reach every actor
through its environment) and its store an S3 bucket (moto's server), as on a cluster. (A shared folder
as the store goes through the same blob-store interface, tested per backend in tests/runtime; the README's tour
resumes a run on the local store.) The first run directory is deleted after the kill, so the resumed run can
have nothing from it: ``runtime.up --resume RUN_ID --set bus.url=... --set storage.url=...`` must find the run's
configuration, checkpoints and metrics on the bus and in the store. The resumed run finishes by
itself; every admitted prompt is trained once or accounted for, no group is trained twice, and the
weights are published under the run id.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from actors.__main__ import DEFAULT_RUN_FILE
from actors.training.checkpoint_store import download_checkpoint, stored_checkpoints
from actors.training.starting_policy import ensure_starting_policy
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from runtime.blob import open_store
from runtime.blob.testing import MotoServer
from runtime.bus_auth import generate_credentials
from runtime.metrics_log import read_metrics
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.run_config import load_run_config
from runtime.up import bus_roles
from tests.integration.harness import REPO, LiveRun, alive, descendants, run_events, write_config
from tests.waiting import until

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS = 4
OVERLAY = """
[run]
name = "elsewhere"
seed = 3
steps = {steps}
[policy]
checkpoint = "{checkpoint}"
[tasks]
num_heldout = 4
difficulties = [1, 2]
[reconciler]
num_slots = 16
group_size = 4
batch_size_groups = 2
[reconciler.scheduling]
eta = 2
rollout_timeout_s = 30.0
reward_timeout_s = 30.0
group_timeout_s = 30.0
[eval]
every_versions = 100
samples_per_task = 1
[rollout.agent]
max_turns = 2
max_new_tokens_per_turn = 128
[bus]
ack_wait_s = 5.0
"""


@dataclass(frozen=True)
class Cluster:
    """What outlives one machine: the bus and the store, and how to reach them."""

    overrides: tuple[str, ...]  # --set arguments naming them
    storage_url: str
    s3_endpoint: str


@pytest.fixture(scope="module")
def starting_policy() -> Path:
    return ensure_starting_policy(REPO / "runs" / "_cache")


@pytest.fixture
async def bus_of_its_own(tmp_path: Path, starting_policy: Path) -> AsyncIterator[tuple[list[Path], list[str]]]:
    """A nats-server with a user per role of the run (its JetStream store outside any run directory)."""
    configs = [DEFAULT_RUN_FILE, write_config(tmp_path / "overlay.toml",
                                              OVERLAY.format(steps=STEPS, checkpoint=starting_policy))]
    users = generate_credentials(tmp_path / "credentials", bus_roles(load_run_config(configs).runtime))
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats", users=tuple(users))) as server:
        yield configs, ["--set", f"bus.url={server.url}", "--set", f"bus.credentials_dir={tmp_path / 'credentials'}"]


async def _kill_mid_run_and_resume_elsewhere(tmp_path: Path, configs: list[Path], cluster: Cluster) -> None:
    first = await LiveRun(tmp_path / "machine-a", configs, *cluster.overrides).start()
    try:
        assert first.info is not None and first.proc is not None
        run_id = first.info.run
        assert run_id != first.run_dir.name, "the run's id is its own, not the directory's name"

        async def trained_steps() -> int:
            async with open_store(cluster.storage_url, s3_endpoint=cluster.s3_endpoint or None) as store:
                return len(await read_metrics(store, kind="train"))

        await until(lambda: trained_steps(), 420, "a first trained step")
        await asyncio.sleep(3.0)  # the next batch's rollouts and rewards in flight
        processes = descendants(first.proc.pid)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        await until(lambda: not any(alive(p) for p in processes), 30, "the actors dying with runtime.up")
    finally:
        await first.stop()
    killed_at = await trained_steps()
    assert killed_at < STEPS, f"the run was killed after its last step ({killed_at}): nothing left to resume"
    shutil.rmtree(first.run_dir)  # machine A is gone, with everything on its disk

    second = LiveRun(tmp_path / "machine-b", [], "--resume", run_id, *cluster.overrides)
    await second.start(timeout_s=120)
    try:
        assert second.proc is not None and second.info is not None and second.info.run == run_id
        assert await second.wait_exit(600) == 0, second.output()
    finally:
        await second.stop()

    async with open_store(cluster.storage_url, s3_endpoint=cluster.s3_endpoint or None) as store:
        rows = await read_metrics(store, kind="train")
        assert [r["version"] for r in rows] == list(range(1, STEPS + 1)), "each step trained and reported once"
        trained = [g for r in rows for g in r["group_ids"]]
        assert len(trained) == len(set(trained)), f"no group trained twice: {trained}"
        newest = (await stored_checkpoints(store))[-1]
        state = json.loads((await download_checkpoint(store, newest, tmp_path / "ckpt")).joinpath(
            "trainer_state.json").read_text())
        assert state["version"] == STEPS and sorted(state["trained_groups"]) == sorted(trained)
        reader = WeightSubscriber(store, SubscriberConfig(run=run_id))
        assert (await reader.versions())[-1] == STEPS, "the weights are published under the run id"
        reader.close()
        evaluated = [r["version"] for r in await read_metrics(store, kind="eval")]
        assert STEPS in evaluated
    # Every admitted prompt is trained once or accounted for: the resumed reconciler's table agrees.
    (accounting,) = run_events(second.run_dir, "reconciler_accounting")
    dropped = accounting["counters"].get("dropped_groups", 0)
    live = set(accounting["live_groups"])
    assert live.isdisjoint(trained)
    assert accounting["cursor_position"] == len(trained) + dropped + len(live), accounting
    assert run_events(second.run_dir, "learner_resumed"), "the trainer resumed from the stored checkpoint"
    (taken,) = run_events(second.run_dir, "lease_taken_over")  # the killed runtime.up's, once it lapsed
    assert str(first.run_dir) in taken["lapsed_holder"]


@pytest.mark.usefixtures("aws_env")
async def test_runtime_up_killed_and_resumed_from_a_fresh_directory_on_s3(
        tmp_path: Path, bus_of_its_own: tuple[list[Path], list[str]], moto: MotoServer) -> None:
    boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket="runs")
    storage = "s3://runs/elsewhere"
    overrides = (*bus_of_its_own[1], "--set", f"storage.url={storage}", "--set", f"storage.s3_endpoint={moto.endpoint}")
    await _kill_mid_run_and_resume_elsewhere(tmp_path, bus_of_its_own[0], Cluster(overrides, storage, moto.endpoint))
