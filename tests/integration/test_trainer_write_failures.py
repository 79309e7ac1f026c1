"""The real trainer, a write after its step failing (its checkpoint, its row, its metrics), and a batch with one
corrupt group record: the trainer answers "already trained" only from what its store holds, and one bad record
costs its own group only. This test plays the reconciler.

After a failed write the step in memory is rolled back to the newest stored checkpoint (weights, optimizer
moments, ledger) in the same process, no restart: the redelivered order is trained again, every version is
stored, published and announced, each batch trains once and each step reports one row, and counts its samples
and busy time once. With trainer.checkpoint_every = 2 a rollback that would drop an acknowledged step fails
the trainer instead (it restarts from storage). A truncated group
record beside a healthy one: the healthy one trains, the corrupt one is named in ``TrainDone.dropped`` with
why, and a redelivery of that batch gets the same answer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zstandard

from actors.messages import COMPLETION_TYPES, all_order_types
from actors.reconciler.work import StageFailed, TrainDone, TrainOrder
from actors.records import encode_record
from actors.training.checkpoint_store import download_checkpoint, stored_checkpoints
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from ops.tail import event_time
from runtime.blob import BlobStore, open_store
from runtime.bus import DONE_QUEUE
from runtime.codec import Codec
from runtime.metrics_log import read_run_metrics
from runtime.rundir import RunInfo
from tests.actors.training.test_learner import _group
from tests.integration.faulty_actors import FAILED_WRITES
from tests.integration.harness import LiveRun, run_events, write_config
from tests.waiting import until

pytestmark = pytest.mark.timeout(400)

RUN = """
[actors.trainer]
entry = "{entry}"
max_concurrency = 1
heartbeat_s = 1.0
[policy]
checkpoint = "{checkpoint}"
[trainer]
checkpoint_every = {checkpoint_every}
[tasks]
num_train = 8
num_heldout = 2
difficulties = [1]
"""

Train = Callable[[str, int, tuple[str, ...]], Awaitable[Any]]


@contextlib.asynccontextmanager
async def _trainer_run(tmp_path: Path, entry: str, num_groups: int, truncated: tuple[int, ...] = (),
                       checkpoint_every: int = 1) -> AsyncIterator[tuple[LiveRun, BlobStore, Train]]:
    """A run of the trainer alone, group records g1..g<num_groups> in its store (``truncated`` ones cut in half)
    and a way to send it an order and get its completion."""
    ckpt = tmp_path / "policy"
    model = MoETransformer(tiny()).init_weights(0)
    save_checkpoint(model, ckpt)
    cfg = write_config(tmp_path / "run.toml",
                       RUN.format(entry=entry, checkpoint=ckpt, checkpoint_every=checkpoint_every))
    run = await LiveRun(tmp_path / "run", cfg).start()
    try:
        assert run.bus is not None
        await run.wait_actors("trainer", 1, timeout_s=180)
        await until(lambda: run_events(run.run_dir, "weights_announced") or run_events(run.run_dir, "weights_verified"),
                    120, "version 0 announced", every_s=0.5)
        await run.bus.ensure_queue(DONE_QUEUE)
        orders, done = Codec(all_order_types()), Codec(COMPLETION_TYPES)
        sub = await run.bus.js.pull_subscribe_bind(durable=DONE_QUEUE.durable, stream=DONE_QUEUE.stream)

        async def train(batch: str, attempt: int, groups: tuple[str, ...]) -> Any:
            await run.bus.publish_durable("work.train", await orders.encode(TrainOrder(
                batch, attempt, groups, tuple(f"groups/{g}/a0" for g in groups), (), 0, 100)))
            (raw,) = await sub.fetch(1, timeout=180)
            await raw.ack()
            return await done.decode(raw.data)

        async with open_store((run.run_dir / "blobs").as_uri()) as store:
            for seed in range(1, num_groups + 1):
                record = zstandard.ZstdCompressor().compress(encode_record(_group(model, [1.0, 0.0, 0.0, 1.0], seed)))
                await store.put(f"groups/g{seed}/a0", record[:len(record) // 2] if seed in truncated else record)
            yield run, store, train
    finally:
        assert await run.stop() == 0


def _counted_once(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's counters around each step (``trainer_counters``): a step that succeeds adds its 4 samples
    and its time; one rolled back to the version before it adds nothing (its retraining counts it); one whose
    own checkpoint was stored keeps its samples (it is answered "already trained", never trained again)."""
    # in the order they happened: a restarted trainer logs to a file of its own, and files are read in no order
    never = datetime.min.replace(tzinfo=UTC)
    steps = sorted(run_events(run_dir, "trainer_counters"), key=lambda e: event_time(e) or never)
    for e in steps:
        if e["failed"] and e["version"] == e["version_before"]:
            assert (e["num_samples"], e["busy_s"]) == (e["num_samples_before"], e["busy_s_before"]), e
        else:
            assert e["num_samples"] == e["num_samples_before"] + 4, e
            assert e["failed"] or e["busy_s"] > e["busy_s_before"], e
    return steps


async def _stored_state(store: BlobStore, cache: Path) -> tuple[str, dict[str, Any]]:
    newest = (await stored_checkpoints(store))[-1]
    return newest, json.loads((await download_checkpoint(store, newest, cache) / "trainer_state.json").read_text())


async def test_after_a_failed_write_the_trainer_answers_already_trained_only_from_its_stored_checkpoint(
        tmp_path: Path) -> None:
    async with _trainer_run(tmp_path, "tests.integration.faulty_actors:WriteFailingTrainerActor", 3) as (
            run, store, train):
        for version in FAILED_WRITES:  # each step has one write fail after it, and is trained again
            trained = await train(f"b{version}", 0, (f"g{version}",))
            assert isinstance(trained, TrainDone) and trained.trainer_version == version, trained
        newest, state = await _stored_state(store, tmp_path / "ckpt")
        await until(lambda: 3 in {e["version"] for e in run_events(run.run_dir, "weights_announced")}, 60,
                    "version 3 announced", every_s=0.5)
        reader = WeightSubscriber(store, SubscriberConfig(run=RunInfo.read(run.run_dir).run))
        published = await reader.versions()
        reader.close()
    run_dir = run.run_dir
    assert published == [0, 1, 2, 3], "every version trained is stored whole (old: the step kept in memory only)"
    assert newest == "step-0000003" and state["trained_batches"] == ["b1", "b2", "b3"], (newest, state)
    assert {e["version"] for e in run_events(run_dir, "weights_announced")} >= {1, 2, 3}
    rolled = run_events(run_dir, "trainer_step_rolled_back")
    assert sorted(e["version"] for e in rolled) == sorted(FAILED_WRITES), rolled
    assert len(run_events(run_dir, "trainer_restored")) == len(FAILED_WRITES)
    assert not run_events(run_dir, "actor_crashed"), "no restart: the trainer went back to its stored checkpoint"
    rows = sorted(r["version"] for r in await read_run_metrics(run_dir, kind="train"))
    assert rows == [1, 2, 3], f"each step reported once: {rows}"
    steps = _counted_once(run_dir)  # old: the rolled-back steps 1 and 2 counted their samples twice
    assert [(e["version_before"], e["version"], e["failed"]) for e in steps] == [
        (0, 0, True), (0, 1, False), (1, 1, True), (1, 2, False), (2, 3, True)], steps
    assert steps[-1]["num_samples"] == 12, "3 steps of 4 samples"


async def test_with_sparse_checkpoints_a_rollback_past_acknowledged_steps_fails_the_trainer(tmp_path: Path) -> None:
    """trainer.checkpoint_every = 2: version 3's failed write goes back in place to the stored version 2 (its
    samples and time taken back with it); version 4's would go back past version 3, already acknowledged: the
    trainer fails instead, saying so, and the restarted one resumes from version 2 as a restart always did."""
    async with _trainer_run(tmp_path, "tests.integration.faulty_actors:SparseWriteFailingTrainerActor", 4,
                            checkpoint_every=2) as (run, store, train):
        for version in (1, 2, 3):
            trained = await train(f"b{version}", 0, (f"g{version}",))
            assert isinstance(trained, TrainDone) and trained.trainer_version == version, trained
        after_restart = await train("b4", 0, ("g4",))  # version 4's row fails: restarted from the stored 2
        assert isinstance(after_restart, TrainDone) and after_restart.trainer_version == 3, after_restart
        newest, _ = await _stored_state(store, tmp_path / "ckpt")
    run_dir = run.run_dir
    assert newest == "step-0000002"
    assert [e["version"] for e in run_events(run_dir, "trainer_step_rolled_back")] == [3], \
        "version 3 rolled back in place; version 4 not (old: both)"
    (failing,) = run_events(run_dir, "actor_failing")
    assert "newest stored checkpoint is version 2 (trainer.checkpoint_every = 2)" in failing["reason"], failing
    assert "versions 3..3 were acknowledged but are in no checkpoint" in failing["reason"], failing
    assert len(run_events(run_dir, "actor_crashed")) >= 1, "the trainer failed and was restarted"
    steps = _counted_once(run_dir)  # old: the rolled-back version 3 counted its samples and time twice
    assert [(e["version_before"], e["version"], e["failed"]) for e in steps] == [
        (0, 1, False), (1, 2, False), (2, 2, True), (2, 3, False), (3, 4, True), (2, 3, False)], steps


async def test_a_truncated_group_record_drops_its_group_alone_and_the_healthy_one_trains(tmp_path: Path) -> None:
    async with _trainer_run(tmp_path, "actors.stages.trainer:TrainerActor", 3, truncated=(2,)) as (run, store, train):
        mixed = await train("b1", 0, ("g1", "g2"))
        assert isinstance(mixed, TrainDone) and mixed.trainer_version == 1, mixed
        ((dropped, why),) = mixed.dropped
        assert dropped == "g2" and "groups/g2/a0" in why and "corrupt" in why and "must run again" not in why
        again = await train("b1", 1, ("g1", "g2"))  # redelivered or re-issued: the same answer
        assert isinstance(again, TrainDone) and (again.trainer_version, again.dropped) == (1, mixed.dropped)
        alone = await train("b2", 0, ("g2",))  # nothing left to train: the batch is refused, naming why
        assert isinstance(alone, StageFailed) and "no group can be trained" in alone.reason and "g2" in alone.reason
        missing = await train("b3", 0, ("g4", "g3"))  # a record never written, beside a healthy one
        assert isinstance(missing, TrainDone) and missing.trainer_version == 2, missing
        assert [(g, "missing" in w) for g, w in missing.dropped] == [("g4", True)]
        _, state = await _stored_state(store, tmp_path / "ckpt")
    assert sorted(state["trained_groups"]) == ["g1", "g3"], "no unreadable group is in the ledger"
    rows = sorted(await read_run_metrics(run.run_dir, kind="train"), key=lambda r: r["version"])
    assert [(r["group_ids"], r["num_samples"]) for r in rows] == [(["g1"], 4), (["g3"], 4)]
