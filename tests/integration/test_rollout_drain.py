"""A rollout waiting for a policy version that never comes neither waits for ever nor holds up a drain:
stopping the run gives its order back at once, and the actor exits cleanly, its sandboxes unmounted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from actors.config import TasksSection
from actors.messages import all_order_types
from actors.reconciler.work import RolloutOrder
from actors.stages.scratch import scratch_root
from actors.task_catalog import TaskCatalog
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from runtime.bus_auth import control_subject
from runtime.codec import Codec
from sandbox._mount import mounts_under
from tests.integration.harness import LiveRun, write_config
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

RUN = """
[supervisor]
drain_timeout_s = 60.0
[actors.rollout]
entry = "actors.stages.rollout:RolloutActor"
max_concurrency = 4
[policy]
checkpoint = "{checkpoint}"
[tasks]
num_train = 8
num_heldout = 4
difficulties = [1]
"""


async def test_a_drain_gives_back_an_order_waiting_for_weights_that_never_come(tmp_path: Path) -> None:
    ckpt = tmp_path / "policy"
    save_checkpoint(MoETransformer(tiny()).init_weights(0), ckpt)
    run = await LiveRun(tmp_path / "run", write_config(tmp_path / "run.toml", RUN.format(checkpoint=ckpt))).start()
    try:
        assert run.bus is not None
        (actor,) = await run.wait_actors("rollout", 1, timeout_s=120)
        prompt = TaskCatalog.build(TasksSection(num_train=8, num_heldout=4, difficulties=(1,))).prompt_id(0)
        order = RolloutOrder("s0", 1, prompt, "g0", 0, 5)  # admitted under version 5: no trainer will make it
        await run.bus.publish_durable("work.rollout", await Codec(all_order_types()).encode(order))

        async def holds_the_order() -> bool:
            return (await run.request(control_subject(actor["kind"], actor["id"], "status")))["num_inflight"] >= 1

        await until(holds_the_order, 60, "the rollout actor to take the order", every_s=0.2)
        started = time.monotonic()
    finally:
        assert await run.stop() == 0
    stopped_in = time.monotonic() - started
    events = [json.loads(line) for f in (run.run_dir / "logs").glob("*.jsonl") for line in f.read_text().splitlines()]
    names = {e["event"] for e in events}
    assert stopped_in < 30 and "actor_drain_timeout" not in names and "actor_killed" not in names, stopped_in
    failed = [e for e in events if e["event"] == "handler_failed" and e.get("queue") == "work_rollout"]
    assert failed and "draining while waiting for weights version 5" in failed[0]["error"], failed
    root = scratch_root("rollout", run.run_dir)
    assert not root.exists() and not mounts_under(str(root))
