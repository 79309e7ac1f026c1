"""The product's main job, end to end and for real: runtime.up with every RL actor, the cached starting
policy, sandboxed rewards, delta weight sync; plus kill -9 of stage actors in the middle of a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import zstandard
from safetensors.torch import load_file

from actors.__main__ import DEFAULT_RUN_FILE, PRESETS_DIR
from actors.records import RolloutRecord, decode_record
from actors.rollout_checkpoint import RolloutCheckpoint
from actors.training.starting_policy import ensure_starting_policy
from runtime.metrics_log import read_run_metrics
from tests.integration.harness import REPO, LiveRun, run_events, write_config
from tests.waiting import until

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

# The shipped short run (actors/runs/short.toml, `python -m actors --preset short`) with this test's seed, steps
# and starting policy, and a larger held-out evaluation (8 tasks, 2 samples each: pass@1 is read from it).
SHORT_PRESET = PRESETS_DIR / "short.toml"
SHORT_RUN = """
[run]
name = "e2e"
seed = {seed}
steps = {steps}

[policy]
checkpoint = "{checkpoint}"
[tasks]
num_heldout = 8
[eval]
samples_per_task = 2
"""


@pytest.fixture(scope="session")
def starting_policy() -> Path:
    return ensure_starting_policy(REPO / "runs" / "_cache")


def _short_run(tmp_path: Path, seed: int, steps: int, checkpoint: Path) -> list[Path]:
    overlay = write_config(tmp_path / "run.toml", SHORT_RUN.format(seed=seed, steps=steps, checkpoint=checkpoint))
    return [DEFAULT_RUN_FILE, SHORT_PRESET, overlay]


async def _rows(run_dir: Path, kind: str) -> list[dict]:
    return await read_run_metrics(run_dir, kind=kind)


async def _wait_finished(run: LiveRun, timeout_s: float) -> int:
    return await run.wait_exit(timeout_s)


async def test_short_run_trains_for_real(tmp_path: Path, starting_policy: Path) -> None:
    """The short run on 8 prompts for one epoch, 2 groups a batch: its data runs out at version 4 though run.steps
    asks for 50, and the run ends by itself after its final evaluation."""
    cfg = _short_run(tmp_path, seed=0, steps=50, checkpoint=starting_policy)
    run = await LiveRun(
        tmp_path / "run", cfg, "--set", "tasks.num_train=8", "--set", "reconciler.num_epochs=1"
    ).start()
    try:
        assert await _wait_finished(run, 300) == 0, run.output()
    finally:
        await run.stop()
    train = await _rows(run.run_dir, "train")
    evals = await _rows(run.run_dir, "eval")
    assert [r["version"] for r in train] == [1, 2, 3, 4], "versions advanced one per step, up to the data's end"
    supervisor = [json.loads(line) for line in (run.run_dir / "logs" / "supervisor.jsonl").read_text().splitlines()]
    (finish,) = [e for e in supervisor if e["event"] == "run_finish_requested"]
    assert finish["reason"] == "data exhausted"
    # the end of a healthy run needs nobody: orders past the data's end are dropped (work_dropped, info)
    assert [e["detail"] for e in run_events(run.run_dir, "message_dead_lettered")] == []
    assert {e["version"] for e in evals} == {0, 4}, "held-out evaluation at the start and at the last version"
    assert any(r["num_versions_in_batch"] >= 2 for r in train), "samples of 2+ policy versions trained together"
    assert max(r["lag_max"] for r in train) <= 2, "lag within eta"
    # A batch whose groups all have equal rewards carries no gradient (and is not computed).
    assert any(r["num_computed"] for r in train), "some batch carried a learning signal"
    assert all(r["grad_norm"] > 0 for r in train if r["num_computed"])
    trained = load_file(str(sorted((run.run_dir / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
    start = load_file(str(starting_policy / "model.safetensors"))
    assert any(not torch.equal(trained[k].float(), start[k].float()) for k in start), "the weights changed"
    logs = run.run_dir / "logs"
    scored = [
        json.loads(line)
        for f in logs.glob("reward-*.jsonl")
        for line in f.read_text().splitlines()
        if '"sandbox_scored"' in line
    ]
    assert len(scored) >= 4 * 2 * 4 and all(s["num_total"] == 5 for s in scored), "rewards from sandboxed tests"
    published = [
        json.loads(line)
        for f in logs.glob("trainer-*.jsonl")
        for line in f.read_text().splitlines()
        if '"weights_announced"' in line
    ]
    assert [p["version"] for p in published][:5] == [0, 1, 2, 3, 4]
    assert any(p["base_version"] is not None for p in published), "versions after the anchor travel as deltas"
    assert published[-1]["num_encoded_bytes"] < published[-1]["num_weight_bytes"]
    assert any((run.run_dir / "checkpoints").glob("step-*")), "model and optimizer checkpoints were written"
    swapped = [json.loads(line) for f in logs.glob("rollout-*.jsonl") for line in f.read_text().splitlines()
               if '"weights_swapped"' in line and '"engine"' in line]
    assert [s["version"] for s in swapped] == sorted({s["version"] for s in swapped}), "versions applied in order"
    assert {s["version"] for s in swapped} >= {1, 2, 3}, "rollout actors hot-loaded the versions through deltas"
    mixed = 0
    for blob in (run.run_dir / "blobs" / "samples").glob("*/a*/trajectory"):
        record = decode_record(zstandard.ZstdDecompressor().decompress(blob.read_bytes()), RolloutRecord, str(blob))
        mixed += len({v for seg in record.trajectory.segments for v in seg.versions if v >= 0}) >= 2
    assert mixed >= 1, "some trajectories carry tokens of two versions: weights swapped mid-rollout"


async def test_stage_actors_killed_mid_run_lose_no_sample_and_a_rollout_resumes_from_its_checkpoints(
    tmp_path: Path, starting_policy: Path
) -> None:
    """kill -9 of a rollout, a reward and a grouping actor in one real run: the run trains every version with
    every prompt accounted, each victim crashed and restarted once. The rollout actor is killed while it holds
    an episode with a turn checkpointed and not finished: the real rollout's own resume path, end to end, its
    re-issued attempts resuming from those checkpoints in rebuilt sandboxes, each finishing a transcript whose
    beginning is the checkpoint's."""
    steps = 4
    cfg = _short_run(tmp_path, seed=1, steps=steps, checkpoint=starting_policy)
    run = await LiveRun(
        tmp_path / "run", cfg,
        "--set", "bus.ack_wait_s=5.0",
        "--set", "reconciler.scheduling.rollout_timeout_s=20.0",
        "--set", "reconciler.scheduling.reward_timeout_s=20.0",
        "--set", "reconciler.scheduling.group_timeout_s=20.0",
        "--set", "rollout.agent.max_turns=3",
        "--set", "rollout.agent.max_new_tokens_per_turn=96",
    ).start()
    blobs, kept = run.run_dir / "blobs", tmp_path / "checkpoints-at-the-kill"
    try:
        (victim,) = await run.wait_actors("rollout", 1, timeout_s=180)

        def half_done() -> list[Path]:
            finished = {e["sample_id"] for e in run_events(run.run_dir, "rollout_finished")}
            return [c for c in blobs.glob("samples/*/a0/checkpoints/t*") if c.parts[-4] not in finished]

        await until(half_done, 240, "an episode with a turn checkpointed and not finished")
        os.kill(victim["pid"], signal.SIGKILL)
        for c in blobs.glob("samples/*/a0/checkpoints/t*"):  # what the dead actor left, before any is collected
            (kept / c.relative_to(blobs)).parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(c, kept / c.relative_to(blobs))
        for kind in ("reward", "grouping"):
            victims = await run.wait_actors(kind, 1, timeout_s=180)
            await asyncio.sleep(2.0)
            os.kill(victims[0]["pid"], signal.SIGKILL)
        assert await _wait_finished(run, 360) == 0, run.output()
    finally:
        await run.stop()
    assert [r["version"] for r in await _rows(run.run_dir, "train")] == list(range(1, steps + 1))
    supervisor = (run.run_dir / "logs" / "supervisor.jsonl").read_text()
    assert supervisor.count('"actor_crashed"') == 3 and supervisor.count('"actor_restarted"') == 3
    # (a replacement may also resume from checkpoints written after the kill: its own, of attempts it redid)
    resumed = [e for e in run_events(run.run_dir, "rollout_resumed") if (kept / e["key"]).exists()]
    assert resumed, "re-issued attempts resumed from the killed actor's checkpoints"
    finished = {(e["sample_id"], e["attempt"]): e for e in run_events(run.run_dir, "rollout_finished")}
    for e in resumed:
        checkpoint = decode_record(zstandard.ZstdDecompressor().decompress((kept / e["key"]).read_bytes()),
                                   RolloutCheckpoint, e["key"])
        assert checkpoint.trajectory.num_turns == e["num_turns"] >= 1
        path = blobs / "samples" / e["sample_id"] / f"a{e['attempt']}" / "trajectory"
        if not path.exists():  # its group was dropped or trained and collected; the event says what it did
            continue
        done = decode_record(zstandard.ZstdDecompressor().decompress(path.read_bytes()), RolloutRecord, str(path))
        before, after = checkpoint.trajectory.segments[0], done.trajectory.segments[0]
        n = len(before.token_ids)
        assert after.token_ids[:n] == before.token_ids and after.versions[:n] == before.versions
        assert after.behaviour_logprobs[:n] == before.behaviour_logprobs, "the checkpointed turns kept as they were"
        assert done.trajectory.num_turns >= checkpoint.trajectory.num_turns
        report = finished[(e["sample_id"], e["attempt"])]
        assert report["num_resumed_turns"] == e["num_turns"] and report["num_resumed_tokens"] > 0
    await assert_every_prompt_accounted(run.run_dir, steps=steps)


async def assert_every_prompt_accounted(run_dir: Path, steps: int) -> None:
    """Every admitted prompt is trained once or accounted for: the trainer ledger and the durable table agree,
    no batch and no group trained twice."""
    state = json.loads(sorted((run_dir / "checkpoints").glob("step-*"))[-1].joinpath("trainer_state.json").read_text())
    assert len(state["trained_batches"]) == len(set(state["trained_batches"])) == steps
    trained_groups: list[str] = []
    for row in await _rows(run_dir, "train"):
        trained_groups += row["group_ids"]
    assert len(trained_groups) == len(set(trained_groups)), "no group trained twice"
    (accounting,) = [
        json.loads(line)
        for f in (run_dir / "logs").glob("reconciler-*.jsonl")
        for line in f.read_text().splitlines()
        if '"reconciler_accounting"' in line
    ]
    dropped = accounting["counters"].get("dropped_groups", 0)
    live = set(accounting["live_groups"])
    assert live.isdisjoint(trained_groups)
    assert accounting["cursor_position"] == len(trained_groups) + dropped + len(live), accounting
