"""The blob store's disk full in the middle of a real run, then freed: an outage the run waits out.

Every RL actor for real (runtime.up with the default run's actors, a tiny policy, sandboxed rewards), the
run's store on a real tmpfs of its own. Once a version is trained the tmpfs is filled but for a few MiB (the
small records go on a while, the trainer's next checkpoint meets the full disk mid-stream, then every writer) for
`FULL_S` seconds (an outage of 60 s, shortened: the writers meet the full store within a second or two, and
what follows does not depend on how long it lasted below ``blob max_full_s``), then freed. The run says so
(``storage_full`` once per process, with the path and the free space), trains again within 30 s of the
space returning, finishes by itself with every group trained once, no sample or group lost, no restart.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path

import pytest

from actors.__main__ import DEFAULT_RUN_FILE
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from runtime.metrics_log import read_run_metrics
from tests.integration.harness import LiveRun, run_events, write_config
from tests.small_disk import fill, small_tmpfs
from tests.waiting import until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

STEPS, FULL_S, RECOVERY_BOUND_S = 6, 15.0, 30.0
LEFT_BYTES = 12 * 1024 * 1024  # room for the rollouts' small records a while, not for a trainer checkpoint (~48 MB)

RUN = """
[run]
name = "diskfull"
steps = {steps}
[storage]
url = "{store}"
[policy]
checkpoint = "{checkpoint}"
[tasks]
num_heldout = 2
difficulties = [1]
[reconciler]
num_slots = 8
group_size = 2
batch_size_groups = 1
[reconciler.scheduling]
eta = 2
[eval]
every_versions = 2
samples_per_task = 1
[rollout.agent]
max_turns = 1
max_new_tokens_per_turn = 24
"""


def _announced(run_dir: Path) -> int:
    return max((e["version"] for e in run_events(run_dir, "weights_announced")), default=-1)


async def test_a_full_store_is_waited_out_and_the_run_trains_again_once_space_returns(tmp_path: Path) -> None:
    ckpt = tmp_path / "policy"
    save_checkpoint(MoETransformer(tiny()).init_weights(0), ckpt)
    with small_tmpfs(tmp_path / "store", 512 * 1024 * 1024) as store:
        overlay = write_config(tmp_path / "run.toml", RUN.format(steps=STEPS, store=store.as_uri(), checkpoint=ckpt))
        run = await LiveRun(tmp_path / "run", [DEFAULT_RUN_FILE, overlay]).start()
        run_dir = run.run_dir
        try:
            assert run.proc is not None
            await until(lambda: _announced(run_dir) >= 1, 300, "version 1 trained and announced", every_s=0.5)
            filler = fill(store, leave_bytes=LEFT_BYTES)
            at_fill = _announced(run_dir)
            await asyncio.sleep(FULL_S)  # the outage: nothing to wait on but its length
            held = _announced(run_dir)
            filler.unlink()
            freed = time.monotonic()
            await until(lambda: _announced(run_dir) > held, RECOVERY_BOUND_S,
                        "the next version after the space returned", every_s=0.2)
            recovery_s = time.monotonic() - freed
            print(f"recovery: space returned -> version {held + 1} announced in {recovery_s:.1f}s "
                  f"(version {at_fill} when filled, {held} when freed)")
            assert await run.wait_exit(400) == 0, run.output()
        finally:
            await run.stop()
        rows = await read_run_metrics(run_dir, kind="train")  # from the store, while it is mounted

    full = run_events(run_dir, "storage_full")
    assert "trainer" in {e["actor"].split("-")[0] for e in full}, "the trainer met the full store mid-checkpoint"
    per_process = collections.Counter(e["actor"] for e in full)
    assert all(n == 1 for n in per_process.values()), f"said once per process: {per_process}"
    assert all(e["path"] == str(store) and e["free_bytes"] is not None for e in full)
    assert {e["actor"] for e in run_events(run_dir, "storage_recovered")} >= set(per_process)
    assert held <= at_fill + 1, f"a version needs its checkpoint and weights stored: {at_fill} -> {held} while full"
    for bad in ("actor_crashed", "actor_unhealthy", "restart_intensity_exceeded", "group_dropped", "sample_failed",
                "trainer_step_rolled_back", "dead_lettered"):
        assert not run_events(run_dir, bad), f"{bad}: {run_events(run_dir, bad)[:2]}"
    assert sorted(r["version"] for r in rows) == list(range(1, STEPS + 1)), f"each version trained once: {rows}"
    state = json.loads(max((run_dir / "checkpoints").glob("step-*")).joinpath("trainer_state.json").read_text())
    assert state["version"] == STEPS and len(set(state["trained_batches"])) == STEPS
    trained = [g for r in rows for g in r["group_ids"]]
    assert len(trained) == len(set(trained)) == STEPS, f"every group trained once: {trained}"
