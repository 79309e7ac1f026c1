"""A rollout actor whose generation engine FAILED exits non-zero with the reason; its supervisor
starts a new one, which does the order the failed one gave back."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.config import TasksSection
from actors.messages import COMPLETION_TYPES, all_order_types
from actors.reconciler.work import RolloutDone, RolloutOrder
from actors.task_catalog import TaskCatalog
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from runtime.bus import DONE_QUEUE
from runtime.codec import Codec
from tests.integration.harness import LiveRun, run_events, write_config

pytestmark = pytest.mark.timeout(300)

RUN = """
[actors.rollout]
entry = "tests.integration.faulty_actors:EngineFailingRolloutActor"
max_concurrency = 4

[policy]
checkpoint = "{checkpoint}"
[tasks]
num_train = 8
num_heldout = 4
difficulties = [1]
[rollout.agent]
max_turns = 1
max_new_tokens_per_turn = 16
"""


async def test_a_failed_engine_fails_its_actor_and_the_order_is_done_by_the_replacement(tmp_path: Path) -> None:
    ckpt = tmp_path / "policy"
    save_checkpoint(MoETransformer(tiny()).init_weights(0), ckpt)
    run = await LiveRun(tmp_path / "run", write_config(tmp_path / "run.toml", RUN.format(checkpoint=ckpt))).start()
    try:
        assert run.bus is not None
        await run.wait_actors("rollout", 1, timeout_s=120)
        await run.bus.ensure_queue(DONE_QUEUE)
        sub = await run.bus.js.pull_subscribe_bind(durable=DONE_QUEUE.durable, stream=DONE_QUEUE.stream)
        prompt = TaskCatalog.build(TasksSection(num_train=8, num_heldout=4, difficulties=(1,))).prompt_id(0)
        order = RolloutOrder("s0", 1, prompt, "g0", 0, 0)
        await run.bus.publish_durable("work.rollout", await Codec(all_order_types()).encode(order))
        (raw,) = await sub.fetch(1, timeout=180)  # bounded: an actor that kept the order would never answer
        await raw.ack()
        done = await Codec(COMPLETION_TYPES).decode(raw.data)
        assert isinstance(done, RolloutDone) and done.sample_id == "s0" and done.attempt == 1
        failing = run_events(run.run_dir, "actor_failing")
        assert len(failing) == 1 and "generation engine failed" in failing[0]["reason"], failing
        crashed = [e for e in run_events(run.run_dir, "actor_crashed") if e.get("actor_kind") == "rollout"]
        assert len(crashed) == 1 and crashed[0]["returncode"] != 0 and crashed[0]["actor_id"] == failing[0]["actor"]
        finished = [e for e in run_events(run.run_dir, "rollout_finished") if e["sample_id"] == "s0"]
        assert len(finished) == 1 and finished[0]["actor"] != failing[0]["actor"], "done by the replacement"
    finally:
        assert await run.stop() == 0
