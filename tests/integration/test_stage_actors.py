"""The RL stage actors, started for real by runtime.up, driven by hand in the reconciler's place:
rollout (real engine, real sandbox) -> reward (hidden tests in a fresh fork) -> grouping -> trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.config import TasksSection
from actors.messages import COMPLETION_TYPES, all_order_types
from actors.reconciler.work import (
    GroupDone,
    GroupOrder,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    TrainDone,
    TrainOrder,
)
from actors.task_catalog import TaskCatalog
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from runtime.bus import DONE_QUEUE
from runtime.bus_auth import control_subject
from runtime.codec import Codec
from runtime.metrics_log import read_run_metrics
from tests.integration.harness import LiveRun, run_events, write_config
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

STAGES_RUN = """
[actors.rollout]
entry = "actors.stages.rollout:RolloutActor"
max_concurrency = 8
[actors.reward]
entry = "actors.stages.reward:RewardActor"
[actors.grouping]
entry = "actors.stages.grouping:GroupingActor"
[actors.trainer]
entry = "actors.stages.trainer:TrainerActor"
max_concurrency = 1

[policy]
checkpoint = "{checkpoint}"
[tasks]
num_train = 8
num_heldout = 4
difficulties = [1]
[rollout.agent]
max_turns = 2
max_new_tokens_per_turn = 48
"""


async def test_one_batch_through_every_stage(tmp_path: Path) -> None:
    ckpt = tmp_path / "policy"
    save_checkpoint(MoETransformer(tiny()).init_weights(0), ckpt)
    cfg = write_config(tmp_path / "run.toml", STAGES_RUN.format(checkpoint=ckpt))
    run = await LiveRun(tmp_path / "run", cfg).start()
    try:
        assert run.bus is not None
        entries = {kind: (await run.wait_actors(kind, 1, timeout_s=120))[0]
                   for kind in ("rollout", "reward", "grouping", "trainer")}
        for kind in ("rollout", "reward"):  # the health probes: one token decoded, one sandboxed command run
            assert (await run.request(control_subject(kind, entries[kind]["id"], "probe"), timeout=60)) == {"ok": True}
        await run.bus.ensure_queue(DONE_QUEUE)
        orders = Codec(all_order_types())
        done = Codec(COMPLETION_TYPES)
        sub = await run.bus.js.pull_subscribe_bind(durable=DONE_QUEUE.durable, stream=DONE_QUEUE.stream)

        async def next_done():
            while True:
                try:
                    (raw,) = await sub.fetch(1, timeout=60)
                except TimeoutError:
                    continue
                await raw.ack()
                return await done.decode(raw.data)

        tasks = TaskCatalog.build(TasksSection(num_train=8, num_heldout=4, difficulties=(1,)))
        prompt = tasks.prompt_id(0)
        samples = [f"s{i}" for i in range(2)]
        for i, s in enumerate(samples):
            await run.bus.publish_durable("work.rollout", await orders.encode(RolloutOrder(s, 1, prompt, "g0", i, 0)))
        rolled = [await next_done() for _ in samples]
        assert all(isinstance(d, RolloutDone) and d.min_version == 0 for d in rolled), rolled
        for d in rolled:
            await run.bus.publish_durable("work.reward", await orders.encode(
                RewardOrder(d.sample_id, 1, prompt, "g0", d.result_key)))
        rewarded = {d.sample_id: d for d in [await next_done() for _ in samples]}
        assert all(isinstance(d, RewardDone) for d in rewarded.values())
        await run.bus.publish_durable("work.group", await orders.encode(
            GroupOrder("g0", 1, prompt, tuple(samples), tuple(rewarded[s].result_key for s in samples))))
        grouped = await next_done()
        assert isinstance(grouped, GroupDone)
        train = TrainOrder("b0", 1, ("g0",), (grouped.result_key,), tuple(samples), 0, 2)
        await run.bus.publish_durable("work.train", await orders.encode(train))
        trained = await next_done()
        assert isinstance(trained, TrainDone) and trained.trainer_version == 1
        repeat = TrainOrder("b0", 2, ("g0",), (grouped.result_key,), tuple(samples), 0, 2)  # a re-issue
        await run.bus.publish_durable("work.train", await orders.encode(repeat))
        again = await next_done()
        assert isinstance(again, TrainDone) and again.trainer_version == 1, "a batch is trained at most once"
        made_up = TrainOrder("b-made-up", 0, ("g0",), (grouped.result_key,), tuple(samples), 0, 2)  # a forged id
        await run.bus.publish_durable("work.train", await orders.encode(made_up))
        forged = await next_done()
        assert isinstance(forged, TrainDone) and forged.trainer_version == 1, "a group is trained at most once"
        metrics = await read_run_metrics(run.run_dir)
        assert [(r["kind"], r["version"]) for r in metrics] == [("train", 1)]
        assert any((run.run_dir / "checkpoints").glob("step-0000001"))
        def rollout_took_version_1() -> bool:  # fetched and applied in the background, after TrainDone
            return any(e["kind"] == "rollout" and 1 in (e.get("version"), e.get("new_version"))
                       for e in run_events(run.run_dir, "weights_swapped"))

        await until(rollout_took_version_1, 60, "the rollout actor to take version 1 in flight")
    finally:
        assert await run.stop() == 0
