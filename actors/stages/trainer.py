"""The trainer actor: train on batches of READY groups, publish each new policy version.

Per order: answer an order whose groups were all trained with their result (idempotent: the ledger is
by group, so a group trains at most once whatever batch id an order gives it), refuse one naming some
trained and some untrained groups or group records that are not the groups it names, refuse if
training now would break the staleness bound; otherwise load the group checkpoints, take one learner step, save
weights + optimizer + trained batch ids (safetensors, HF layout), and hand a bf16 copy of the
weights to the publisher, which encodes and uploads the delta in the background and then signals
``weights.<run>``. Per-step metrics go to ``metrics.jsonl`` in the run directory and to the live
progress display.

Weights durability: a version is announced only after its manifest (written last) is in the store,
and the checkpoint of that version is saved before its upload starts. A trainer killed anywhere in
step -> checkpoint -> upload -> announce -> TrainDone restarts from its newest checkpoint and, before
taking an order, verifies that this version is in the store (publishing it again if not) and
announces it: nobody waits for a version that the dead trainer never announced. A publish of the
newest version that fails after the publisher's retries fails the trainer (it exits non-zero and is
restarted, which publishes it again); an older version's failure is only logged, a newer one
supersedes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import structlog

from actors._stage import StageActor, WorkRefused
from actors.agent.policy import load_policy, use_training_precision, weights_run_name
from actors.agent.weights_follower import weights_subject
from actors.messages import WeightsPublished
from actors.reconciler.slot import Stage
from actors.reconciler.work import TrainDone, TrainOrder
from actors.records import GroupRecord
from actors.training.learner import Learner, StepMetrics
from model.weight_sync import PublishedVersion, PublisherConfig, SubscriberConfig, WeightPublisher, WeightSubscriber
from model.weight_sync.manifest import manifest_key
from runtime.actor import Delivery
from runtime.bus_auth import BusAccess
from runtime.codec import Codec
from runtime.metrics_log import append_metrics, read_metrics

log = structlog.get_logger(__name__)

__all__ = ["TrainerActor"]


class StepBudgetReached(RuntimeError):
    """The run trained its ``run.steps``; further batches stay queued for a resumed run."""


PENDING_ROW = "pending-train-row.json"  # in the checkpoint directory: the last step's row until it is in metrics


class TrainerActor(StageActor):
    bus_access = BusAccess(publish=("weights.*", "progress.train"))  # the only one to announce weights
    stage = Stage.TRAIN

    async def setup(self) -> None:
        cfg = self.config
        self.checkpoints = Path(self.ctx.run_dir) / "checkpoints"
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        latest = Learner.latest_checkpoint(self.checkpoints)
        num_steps = self.ctx.run_steps  # the length of a cosine lr schedule
        if latest is not None:
            self.learner = await asyncio.to_thread(Learner.load, latest, cfg.trainer, num_steps)
            use_training_precision(self.learner.model, cfg.policy)
        else:
            model = await asyncio.to_thread(load_policy, cfg.policy, training=True)
            self.learner = Learner(model, cfg.trainer, num_steps=num_steps)
        self.metrics_path = Path(self.ctx.run_dir) / cfg.trainer.metrics_file
        await asyncio.to_thread(self._recover_pending_row)
        self.run_name = weights_run_name(self.ctx.run_dir)
        self.publisher_config = PublisherConfig(run=self.run_name)
        self.publisher = WeightPublisher(self.ctx.blob, self.publisher_config)
        await self.exit_stack.enter_async_context(self.publisher)
        self.signal_codec = Codec([WeightsPublished])
        self.started_at = time.monotonic()
        self.busy_s = 0.0
        self.num_samples = 0
        self.last_submitted = -1
        await self._announce_current()

    async def _announce_current(self) -> None:
        """The learner's version is in the store (verified, or published now) and announced, before any order."""
        version = self.learner.version
        reader = WeightSubscriber(self.ctx.blob, SubscriberConfig(run=self.run_name))
        try:
            published = await reader.versions()
        finally:
            reader.close()
        if published and published[-1] > version:  # steps after the newest checkpoint were lost with the process
            log.error("weights_ahead_of_checkpoint", version=version, newest_published=published[-1],
                      fix="trainer.checkpoint_every = 1 keeps every announced version in a checkpoint")
        if version not in published:  # killed between its checkpoint and the manifest: publish it again
            log.warning("weights_republishing", version=version, newest_published=published[-1] if published else None)
            await self._signal_when_uploaded(self._publish())
            return
        key = manifest_key(self.publisher_config.key_prefix, self.run_name, version)
        log.info("weights_verified", version=version, manifest_key=key)
        await self._announce(WeightsPublished(self.run_name, version, key, 0))

    async def on_config_change(self, key: str, old: Any, new: Any) -> None:
        if key == "trainer.lr":  # the schedule's peak: the rest of the schedule keeps its shape at the new height
            self.learner.set_lr(float(new))

    def status(self) -> dict[str, Any]:
        return {"version": self.learner.version, "num_trained_batches": len(self.learner.trained_batches)}

    async def work(self, order: TrainOrder, delivery: Delivery) -> TrainDone:
        learner = self.learner
        trained = {g: learner.trained_groups[g] for g in order.group_ids if g in learner.trained_groups}
        if trained and len(trained) == len(order.group_ids):
            log.info("batch_already_trained", batch_id=order.batch_id, version=max(trained.values()))
            return TrainDone(order.batch_id, order.attempt, max(trained.values()))
        if trained:
            raise WorkRefused(f"batch {order.batch_id} names groups already trained {sorted(trained)}: "
                              "a group trains at most once")
        steps = self.ctx.run_steps
        if steps and learner.version >= steps:  # nak: the batch waits for a resumed run with more steps
            raise StepBudgetReached(f"the run's step budget ({steps}) is reached; batch {order.batch_id} waits")
        if learner.version > order.deadline_version:
            raise WorkRefused(f"trainer is at version {learner.version}, past the batch's deadline "
                              f"{order.deadline_version}: training it would exceed the staleness bound")
        groups = await self.get_records(list(order.group_keys), GroupRecord, ready=True)
        named = [g.group_id for g in groups]
        if len(set(order.group_ids)) != len(order.group_ids) or named != list(order.group_ids):
            raise WorkRefused(f"batch {order.batch_id} names groups {list(order.group_ids)} but its records "
                              f"hold {named}")
        started = time.monotonic()
        metrics = await asyncio.to_thread(learner.step, groups, order.batch_id)
        self.num_samples += metrics.num_samples
        row = self._row(metrics, order, busy_s=self.busy_s + time.monotonic() - started)
        # The step's row is written before its checkpoint: a trainer killed between the checkpoint and
        # metrics.jsonl appends it when it restarts (`_recover_pending_row`), once, and never twice.
        await asyncio.to_thread(_write_json, self.checkpoints / PENDING_ROW, row)
        if learner.version % self.config.trainer.checkpoint_every == 0:
            await asyncio.to_thread(learner.save, self.checkpoints)
        self.busy_s += time.monotonic() - started
        # Upload runs in the background; the order is acked once the new version is announced.
        delivery.task_group.create_task(self._signal_when_uploaded(self._publish()))
        await self._report(row)
        (self.checkpoints / PENDING_ROW).unlink(missing_ok=True)
        if self.ctx.ready_samples is not None:  # trained: the object store's copies are no longer needed
            await self.ctx.ready_samples.release(list(order.group_keys))
        return TrainDone(order.batch_id, order.attempt, learner.version)

    def _recover_pending_row(self) -> None:
        """The row of the step a killed trainer checkpointed but had not reported yet goes to metrics.jsonl
        now (a row of a step not checkpointed is dropped: that step is trained again)."""
        path = self.checkpoints / PENDING_ROW
        try:
            row = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except ValueError:  # cut short by the kill: its step was not checkpointed either
            row = {}
        version = self.learner.version
        reported = {r.get("version") for r in read_metrics(self.metrics_path, kind="train")}
        if row.get("version") == version and version not in reported:
            append_metrics(self.metrics_path, row)
            log.info("train_row_recovered", version=version, batch_id=row.get("batch_id"))
        path.unlink()

    def _publish(self) -> tuple[int, asyncio.Future[PublishedVersion]]:
        # The step's whole share of publishing: one copy into recycled bf16 buffers.
        version = self.learner.version
        self.last_submitted = version
        return version, self.publisher.submit(version, self.publisher.snapshot(self.learner.model.state_dict()))

    async def _signal_when_uploaded(self, submitted: tuple[int, asyncio.Future[PublishedVersion]]) -> None:
        version, future = submitted
        try:
            published = await future
        except Exception as e:
            if version < self.last_submitted:  # a newer version supersedes it; readers catch up from that one
                log.warning("weights_publish_failed", version=version, superseded_by=self.last_submitted, error=repr(e))
                return
            # The newest version would never reach anyone: fail loudly; the restarted trainer publishes it again.
            self.fail(f"publishing weights version {version} failed: {e!r}")
            raise
        await self._announce(WeightsPublished(self.run_name, published.version, published.manifest_key,
                                              published.num_encoded_bytes))
        log.info("weights_announced", version=published.version, base_version=published.base_version,
                 num_encoded_bytes=published.num_encoded_bytes, num_weight_bytes=published.num_weight_bytes,
                 encode_s=round(published.encode_s, 4), upload_s=round(published.upload_s, 4))

    async def _announce(self, msg: WeightsPublished) -> None:
        await self.bus.publish(weights_subject(self.run_name), await self.signal_codec.encode(msg))
        await self.bus.flush(timeout_s=5.0)  # sent now, not with the next batch of writes: rollouts may be waiting

    def _row(self, m: StepMetrics, order: TrainOrder, *, busy_s: float) -> dict[str, Any]:
        wall = time.monotonic() - self.started_at
        return {"kind": "train", "time": time.time(), "batch_id": order.batch_id, "group_ids": list(order.group_ids),
                **m.to_dict(),
                "samples_per_s": self.num_samples / wall if wall > 0 else 0.0,
                "trainer_utilisation": busy_s / wall if wall > 0 else 0.0}

    async def _report(self, row: dict[str, Any]) -> None:
        await asyncio.to_thread(append_metrics, self.metrics_path, row)
        log.info("train_step", **{k: v for k, v in row.items() if k not in ("lag_histogram", "kind", "group_ids")})
        lag = f"{row['lag_min']}..{row['lag_max']}"
        progress = {"step": row["version"], "reward": round(row["reward_mean"], 3), "pass": round(row["pass_rate"], 3),
                    "lag": lag, "samples/s": round(row["samples_per_s"], 2),
                    "util": round(row["trainer_utilisation"], 2)}
        await self.bus.publish("progress.train", msgpack.packb(progress, use_bin_type=True))


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
