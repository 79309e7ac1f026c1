"""Chaos: the real trainer SIGKILLed at each point of step -> checkpoint -> upload -> announce -> TrainDone, the
real evaluator killed in the middle of an evaluation and before it ends the run, the rollout and reward actors
killed with their sandboxes mounted. The run still finishes by itself: every version is trained once,
published, announced and evaluated once, and no sandbox directory or mount is left behind.

The lightest real harness that has them all: `runtime.up` with the real stage actors and evaluator, this test
in the reconciler's place (one real group, rolled out, rewarded and grouped by the real actors, then trained
as six batches), so each kill point is hit exactly once, at a known version (`faulty_actors.TRAINER_KILLS`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import msgpack
import pytest
import zstandard

from actors.config import TasksSection
from actors.messages import COMPLETION_TYPES, all_order_types
from actors.reconciler.store import META_KEY
from actors.reconciler.work import (
    GroupDone,
    GroupOrder,
    MetaRecord,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    TrainDone,
    TrainOrder,
)
from actors.stages.scratch import scratch_root
from actors.task_catalog import TaskCatalog
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from runtime.blob import open_store
from runtime.bus import DONE_QUEUE
from runtime.codec import Codec
from runtime.metrics_log import read_run_metrics
from runtime.rundir import RunInfo
from sandbox._mount import mounts_under
from tests.integration.faulty_actors import EVALUATOR_KILLED_AT, TRAINER_KILLS
from tests.integration.harness import LiveRun, run_events, write_config

pytestmark = pytest.mark.timeout(600)

NUM_VERSIONS = 6

RUN = """
[run]
steps = {steps}
[bus]
ack_wait_s = 4.0  # a killed trainer's order comes back this soon
[supervisor]
max_restarts = 10
backoff_max_s = 1.0

[actors.rollout]
entry = "actors.stages.rollout:RolloutActor"
max_concurrency = 4
heartbeat_s = 1.0
[actors.reward]
entry = "actors.stages.reward:RewardActor"
heartbeat_s = 1.0
[actors.grouping]
entry = "actors.stages.grouping:GroupingActor"
heartbeat_s = 1.0
[actors.trainer]
entry = "tests.integration.faulty_actors:KilledTrainerActor"
max_concurrency = 1
heartbeat_s = 1.0
[actors.evaluator]
entry = "tests.integration.faulty_actors:KilledEvaluatorActor"
heartbeat_s = 1.0

[policy]
checkpoint = "{checkpoint}"
[tasks]
num_train = 8
num_heldout = 2
difficulties = [1]
[rollout.agent]
max_turns = 1
max_new_tokens_per_turn = 24
[eval]
every_versions = 1
samples_per_task = 1
concurrency = 2
"""


async def _until_replaced(run: LiveRun, kind: str, old_id: str) -> None:
    for _ in range(600):
        if any(a["id"] != old_id for a in await run.wait_actors(kind, 1, timeout_s=120)):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{kind} {old_id} was not replaced")


@pytest.mark.slow
async def test_the_trainer_killed_at_each_point_of_its_sequence_and_the_run_still_finishes(tmp_path: Path) -> None:
    ckpt = tmp_path / "policy"
    save_checkpoint(MoETransformer(tiny()).init_weights(0), ckpt)
    cfg = write_config(tmp_path / "run.toml", RUN.format(steps=NUM_VERSIONS, checkpoint=ckpt))
    run = await LiveRun(tmp_path / "run", cfg).start()
    try:
        assert run.bus is not None and run.proc is not None
        for kind in ("rollout", "reward", "grouping", "trainer"):
            await run.wait_actors(kind, 1, timeout_s=180)
        await run.bus.ensure_queue(DONE_QUEUE)
        orders, done = Codec(all_order_types()), Codec(COMPLETION_TYPES)
        sub = await run.bus.js.pull_subscribe_bind(durable=DONE_QUEUE.durable, stream=DONE_QUEUE.stream)

        async def next_done(timeout_s: float = 120.0):
            (raw,) = await sub.fetch(1, timeout=timeout_s)
            await raw.ack()
            return await done.decode(raw.data)

        async def order(subject: str, msg) -> None:
            await run.bus.publish_durable(subject, await orders.encode(msg))

        prompt = TaskCatalog.build(TasksSection(num_train=8, num_heldout=2, difficulties=(1,))).prompt_id(0)
        samples = ("s0", "s1")
        for i, s in enumerate(samples):
            await order("work.rollout", RolloutOrder(s, 1, prompt, "g0", i, 0))
        rolled = [await next_done() for _ in samples]
        assert all(isinstance(d, RolloutDone) for d in rolled), rolled
        for d in rolled:
            await order("work.reward", RewardOrder(d.sample_id, 1, prompt, "g0", d.result_key))
        rewarded = {d.sample_id: d for d in [await next_done() for _ in samples]}
        assert all(isinstance(d, RewardDone) for d in rewarded.values()), rewarded
        await order("work.group", GroupOrder("g0", 1, prompt, samples, tuple(rewarded[s].result_key for s in samples)))
        grouped = await next_done()
        assert isinstance(grouped, GroupDone), grouped
        # The sandbox actors SIGKILLed too: their replacements must reap the stores and overlay mounts they left.
        rollout_root = scratch_root("rollout", run.run_dir)
        assert mounts_under(str(rollout_root)), "the rollout actor's warm sandboxes are mounted"
        for kind in ("rollout", "reward"):
            (old,) = [a for a in await run.actors() if a["kind"] == kind]
            os.kill(old["pid"], signal.SIGKILL)
            await _until_replaced(run, kind, old["id"])

        # A group trains at most once (the trainer's ledger is by group): the one real group, relabelled
        # g1..gN in the run's store, gives each version a batch of its own.
        async with open_store(f"file://{run.run_dir / 'blobs'}") as store:
            record = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(await store.get(grouped.result_key)))
            for version in range(1, NUM_VERSIONS + 1):
                await store.put(f"groups/g{version}/a1", zstandard.ZstdCompressor().compress(
                    msgpack.packb({**record, "group_id": f"g{version}"}, use_bin_type=True)))
        for version in range(1, NUM_VERSIONS + 1):  # one batch a version, each sent once its predecessor is done
            await order("work.train", TrainOrder(f"b{version}", 1, (f"g{version}",), (f"groups/g{version}/a1",),
                                                 samples, version - 1, NUM_VERSIONS + 10))
            trained = await next_done(timeout_s=180)
            assert isinstance(trained, TrainDone) and trained.batch_id == f"b{version}", trained
            assert trained.trainer_version == version, (version, trained)
            # as the reconciler records it: the evaluator's finish is believed only from this table
            await run.bus.kv_put("slots", META_KEY, MetaRecord(trainer_version=version).encode())
        # The evaluator evaluates the last version and finishes the run: nothing else needs to happen.
        assert await run.wait_exit(300) == 0, run.output()
    finally:
        await run.stop()

    run_dir = run.run_dir
    state = json.loads(max((run_dir / "checkpoints").glob("step-*")).joinpath("trainer_state.json").read_text())
    assert state["version"] == NUM_VERSIONS
    assert state["trained_batches"] == [f"b{v}" for v in range(1, NUM_VERSIONS + 1)], "each batch trained once"
    train_versions = sorted(r["version"] for r in await read_run_metrics(run_dir, kind="train"))
    assert train_versions == list(range(1, NUM_VERSIONS + 1)), f"each step reported once: {train_versions}"
    evaluated = sorted(r["version"] for r in await read_run_metrics(run_dir, kind="eval"))
    assert evaluated == list(range(NUM_VERSIONS + 1)), f"each version evaluated once: {evaluated}"
    assert EVALUATOR_KILLED_AT in evaluated

    async with open_store(f"file://{run_dir / 'blobs'}") as store:
        reader = WeightSubscriber(store, SubscriberConfig(run=RunInfo.read(run_dir).run))
        assert await reader.versions() == list(range(NUM_VERSIONS + 1)), "every version published and whole"
        reader.close()
    announced = sorted({e["version"] for e in run_events(run_dir, "weights_announced")}
                       | {e["version"] for e in run_events(run_dir, "weights_verified")})
    assert announced == list(range(NUM_VERSIONS + 1))

    killed = {e["actor_kind"]: 0 for e in run_events(run_dir, "actor_crashed")}
    for e in run_events(run_dir, "actor_crashed"):
        killed[e["actor_kind"]] += 1
    assert killed == {"trainer": len(TRAINER_KILLS), "evaluator": 2, "rollout": 1, "reward": 1}, killed
    assert sorted(p.name for p in run_dir.glob("fault-*")) == sorted(
        [f"fault-trainer-{point}-v{v}" for v, point in TRAINER_KILLS.items()]
        + ["fault-evaluator", "fault-evaluator-finish"])

    for kind in ("rollout", "reward", "evaluator"):
        root = scratch_root(kind, run_dir)
        assert not root.exists(), f"{root} left behind"
        assert not mounts_under(str(root))
