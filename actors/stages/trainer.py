"""The trainer actor: train on batches of READY groups, publish each new policy version.

Per order: answer an order whose groups were all trained with their result (idempotent: the ledger is
by group, so a group trains at most once whatever batch id an order gives it), refuse one naming some
trained and some untrained groups or group records that are not the groups it names, refuse if
training now would break the staleness bound; otherwise load the group checkpoints, take one learner step, save
weights + optimizer + trained batch ids (safetensors, HF layout), and hand a bf16 copy of the
weights to the publisher, which encodes and uploads the delta in the background and then signals
``weights.<run>``. Checkpoints are kept in the run's blob store (``actors.training.checkpoint_store``;
the run directory's ``checkpoints/`` is this machine's cache), so a trainer resumes from them on any
machine. Per-step metrics go to the store's ``metrics/train/`` (``runtime.metrics_log``) and to the
live progress display.

Weights durability: a version is announced only after its manifest (written last) is in the store,
and the checkpoint of that version is saved before its upload starts. A trainer killed anywhere in
step -> checkpoint -> upload -> announce -> TrainDone restarts from its newest checkpoint and, before
taking an order, verifies that this version is in the store (publishing it again if not) and
announces it: nobody waits for a version that the dead trainer never announced. A publish of the
newest version that fails after the publisher's retries fails the trainer (it exits non-zero and is
restarted, which publishes it again); an older version's failure is only logged, a newer one
supersedes it. Any other write after the step that fails (the store full past its ``max_full_s``,
unavailable past its retries) rolls the learner back to the store's newest checkpoint in place
(``_back_to_stored``): a step is "already trained" only once a stored checkpoint says so (with
``trainer.checkpoint_every`` > 1 a checkpoint older than the step before lacks acknowledged steps: the
trainer fails and restarts from it instead, saying which steps are lost). A group whose
record cannot be read is left out of its batch, named in ``TrainDone.dropped``; the rest trains.

With ``actors.trainer.ranks = N`` the trainer is N processes forming one torch.distributed group
(actors.trainer_group: rendezvous through the bus). Rank 0 alone takes the reconciler's orders; for each
it checks the ledger and bounds as above, then broadcasts the plan (batch id, group keys); every rank
reads its share of the groups from storage and the group exchanges them; all take the step together
(actors.training.ranks: data parallel, and expert parallel with ``trainer.expert_parallel``), write
their checkpoint shards (rank 0 makes the checkpoint visible), and publish their part of the weights;
rank 0 announces the version once every rank's part is durable (the ranks wait for their uploads and
tell each other: a rank's upload is part of its step here, not in the background). A rank that dies fails
the step on every rank (the order is redelivered), the group restarts together and resumes from the
newest checkpoint, whose ledger keeps any group from training twice.

One rank is a group of one: the same sequence (``_train_plan``), its collectives identities called in
place (``RankGroup`` of world size 1). The one difference is where the upload is awaited: a lone rank
tells nobody, so its upload runs in the background while it reports the step (the order is acked once
the version is announced).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import structlog
import torch

from actors._stage import StageActor, WorkRefused
from actors.agent.policy import load_run_policy, use_training_precision
from actors.messages import WeightsPublished
from actors.reconciler.slot import Stage
from actors.reconciler.work import TrainDone, TrainOrder
from actors.records import GroupRecord, TrainerLogprobs, trainer_logprobs_key
from actors.trainer_group import RENDEZVOUS_KEY, GroupBroken, TrainerGroup, rank_device
from actors.training.checkpoint_store import (
    download_checkpoint,
    prune_checkpoints,
    stored_checkpoints,
    upload_checkpoint,
)
from actors.training.learner import Learner, StepMetrics, checkpoint_version
from actors.training.ranks import RankGroup, RankLayout, weights_to_publish
from actors.weights_announcements import weights_run_name, weights_subject
from model.device import resolve_device
from model.weight_sync.manifest import manifest_key
from model.weight_sync.publisher import PublishedVersion, PublisherConfig, WeightPublisher
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from runtime.actor import ActorContext, Delivery
from runtime.actor_launch import RANK_ENV, WORLD_SIZE_ENV
from runtime.blob import BlobError, BlobNotFound
from runtime.bus_auth import BusAccess
from runtime.codec import Codec
from runtime.errors import WorkDropped
from runtime.gather import gather_or_cancel
from runtime.metrics_log import metrics_key, numbered, write_metrics

log = structlog.get_logger(__name__)

__all__ = ["TrainerActor"]

T = TypeVar("T")


def _on_device(device: torch.device, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in this worker thread with ``device`` current: CUDA's current device is per thread, and
    what launches on it (Triton's kernels, tensors made on plain ``cuda``) must find the rank's own GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return fn(*args)


class StepBudgetReached(WorkDropped):
    """The run trained its ``run.steps``: a further batch is the expected end of a run, dropped here (acked, at
    info); the reconciler keeps it in its table and a resumed run with more steps issues it again."""


PENDING_ROW = "trainer/pending-train-row.json"  # in the store: the last step's row until it is in the metrics


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What rank 0 tells the other ranks to train next (None: stop)."""

    batch_id: str
    group_keys: tuple[str, ...]
    group_ids: tuple[str, ...]


class TrainerActor(StageActor):
    # the only one to announce weights; its ranks meet at the rendezvous key (actors.trainer_group)
    bus_access = BusAccess(publish=("weights.*", "progress.train"), kv_keys=(("actors", RENDEZVOUS_KEY),))
    stage = Stage.TRAIN
    max_count = 1
    max_count_reason = ("two trainers would take orders from one queue and train diverging copies of the policy; "
                        "for more trainer processes set actors.trainer.ranks = N (one torch.distributed group, "
                        "data and expert parallel)")
    supports_ranks = True

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.layout = RankLayout(int(os.environ.get(RANK_ENV, "0")), int(os.environ.get(WORLD_SIZE_ENV, "1")),
                                 self.config.trainer.expert_parallel)
        if self.layout.rank > 0:
            self.queues = ()  # only rank 0 takes orders; the others follow its plans
        self._following: asyncio.Future[Any] | None = None  # a rank > 0's plan in progress

    async def setup(self) -> None:
        cfg = self.config
        self.checkpoints = Path(self.ctx.run_dir) / "checkpoints"  # this machine's cache of the stored ones
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.device = device = rank_device(resolve_device(cfg.policy.device), self.layout.rank)  # its own GPU
        if self.layout.world_size > 1:
            self.group = TrainerGroup(self.bus, self.layout, device, cfg.trainer.rendezvous_timeout_s,
                                      cfg.trainer.collective_timeout_s)
            await self.group.join()
            self.exit_stack.callback(self.group.leave)  # the last thing this process does with its peers
        self.ranks = await asyncio.to_thread(RankGroup, self.layout)  # one rank: a group of one, no collective
        # rank 0 fetches the store's newest checkpoint into the cache the ranks share; they all load it
        latest = await self._latest_checkpoint() if self.layout.rank == 0 else None
        latest = await self._collective(self.ranks.broadcast_plan, latest)
        self.learner = await self._learner_from(latest)
        if self.layout.rank == 0:  # the only one that writes rows
            await self._recover_pending_row()
        self.run_name = weights_run_name(self.ctx)
        self.publisher_config = PublisherConfig(run=self.run_name, rank=self.layout.rank,
                                                world_size=self.layout.world_size)
        await self._start_publisher()
        if self.ranks.distributed:
            self.exit_stack.push_async_callback(self._stop_group)  # before the publisher closes
        self.signal_codec = Codec([WeightsPublished])
        self.started_at = time.monotonic()
        self.busy_s = 0.0
        self.num_samples = 0
        self.last_submitted = -1
        await self._announce_current()

    async def _learner_from(self, checkpoint: Path | None) -> Learner:
        """The learner saved at ``checkpoint``, or (None) the run's starting policy at version 0."""
        cfg = self.config
        num_steps = self.ctx.run_steps  # the length of a cosine lr schedule
        if checkpoint is not None:
            learner = await self._compute(Learner.load, checkpoint, cfg.trainer, num_steps, self.device, self.ranks)
            use_training_precision(learner.model, cfg.policy)
            return learner
        policy = dataclasses.replace(cfg.policy, device=str(self.device))
        model = await load_run_policy(self.ctx, policy, training=True)
        return await self._compute(Learner, model, cfg.trainer, 0, num_steps, self.ranks)

    async def _start_publisher(self) -> None:
        self.publisher = WeightPublisher(self.ctx.blob, self.publisher_config)
        await self.exit_stack.enter_async_context(self.publisher)

    async def _announce_current(self) -> None:
        """The learner's version is in the store (verified, or published now) and announced, before any order.
        Rank 0's view of the store decides for the group: every rank publishes its part again, or none does."""
        version = self.learner.version
        published: list[int] = []
        if self.layout.rank == 0:
            reader = WeightSubscriber(self.ctx.blob, SubscriberConfig(run=self.run_name))
            try:
                published = await reader.versions()
            finally:
                reader.close()
            if published and published[-1] > version:  # steps after the newest checkpoint were lost with the process
                log.error("weights_ahead_of_checkpoint", version=version, newest_published=published[-1],
                          fix="trainer.checkpoint_every = 1 keeps every announced version in a checkpoint")
        if not await self._collective(self.ranks.broadcast_plan, version in published):
            if version == 0:  # the starting policy (no checkpoint yet): its first publication, at every fresh start
                log.info("weights_publishing_starting_policy", version=version, rank=self.layout.rank)
            else:  # killed between its checkpoint and the manifest: publish it again
                log.warning("weights_republishing", version=version, rank=self.layout.rank,
                            newest_published=published[-1] if published else None)
            await self._announce_when_durable(self._submit_weights())
            return
        if self.layout.rank == 0:
            key = manifest_key(self.publisher_config.key_prefix, self.run_name, version)
            log.info("weights_verified", version=version, manifest_key=key)
            await self._announce(WeightsPublished(self.run_name, version, key, 0))

    async def on_config_change(self, key: str, old: Any, new: Any) -> None:
        if key == "trainer.lr":  # the schedule's peak: the rest of the schedule keeps its shape at the new height
            self.learner.set_lr(float(new))

    def status(self) -> dict[str, Any]:
        return {"version": self.learner.version, "num_trained_batches": len(self.learner.trained_batches)}

    async def _collective(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a call that may wait on the other ranks: in a thread when there are any (the event
        loop keeps serving the bus meanwhile), in place for a group of one (its collectives return at once)."""
        if self.ranks.distributed:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, work on the model: in a thread (the event loop keeps serving the bus), on this rank's
        device."""
        return await asyncio.to_thread(_on_device, self.device, fn, *args)

    # --- the group (actors.trainer.ranks > 1) --------------------------------------------------------
    async def background(self, tg: asyncio.TaskGroup) -> None:
        if self.ranks.distributed:
            tg.create_task(self._watch_group())
            if self.layout.rank > 0:
                tg.create_task(self._follow())

    async def _watch_group(self) -> None:
        """A rank that restarted broke this group: every rank fails, and the group restarts together."""
        try:
            await self.group.watch_broken()
        except GroupBroken as e:
            self.fail(str(e))

    async def _follow(self) -> None:
        """A rank > 0: rank 0's plans, one after another, until it says stop."""
        while True:
            plan = await asyncio.to_thread(self.ranks.broadcast_plan, None)
            if plan is None:
                log.info("trainer_group_stopping", rank=self.layout.rank)
                self.request_drain()
                return
            # shielded: a drain arriving mid-step must not leave the others waiting in a collective
            self._following = asyncio.ensure_future(self._train_plan(plan))
            try:
                await asyncio.shield(self._following)
            except WorkRefused as e:  # every rank refuses the same plan; rank 0 reports it
                log.info("plan_refused", batch_id=plan.batch_id, rank=self.layout.rank, reason=str(e))

    async def _stop_group(self) -> None:
        if self._following is not None:
            await asyncio.wait({self._following}, timeout=self.config.trainer.collective_timeout_s)
        if self.layout.rank == 0:  # the others stop following
            try:
                await asyncio.to_thread(self.ranks.broadcast_plan, None)
            except RuntimeError as e:  # a peer already gone: it does not need to hear it
                log.warning("trainer_group_stop_unheard", error=repr(e))

    # --- one step: the same sequence on every rank (one rank: a group of one) ------------------------
    async def work(self, order: TrainOrder, delivery: Delivery) -> TrainDone:
        learner = self.learner
        trained = {g: learner.trained_groups[g] for g in order.group_ids if g in learner.trained_groups}
        if trained and len(trained) == len(order.group_ids):
            log.info("batch_already_trained", batch_id=order.batch_id, version=max(trained.values()))
            return TrainDone(order.batch_id, order.attempt, max(trained.values()))
        if trained:
            dropped = await self._unreadable(order, [g for g in order.group_ids if g not in trained])
            if dropped:  # the rest trained when these were left out: the same answer again
                log.info("batch_already_trained", batch_id=order.batch_id, version=max(trained.values()),
                         dropped_group_ids=sorted(dropped))
                return TrainDone(order.batch_id, order.attempt, max(trained.values()), dropped=tuple(dropped.items()))
            raise WorkRefused(f"batch {order.batch_id} names groups already trained {sorted(trained)}: "
                              "a group trains at most once")
        steps = self.ctx.run_steps
        if steps and learner.version >= steps:
            raise StepBudgetReached(f"the run's step budget ({steps}) is reached; batch {order.batch_id} is left "
                                    "to a resumed run with more steps")
        if learner.version > order.deadline_version:
            raise WorkRefused(f"trainer is at version {learner.version}, past the batch's deadline "
                              f"{order.deadline_version}: training it would exceed the staleness bound")
        plan = TrainPlan(order.batch_id, tuple(order.group_keys), tuple(order.group_ids))
        await self._collective(self.ranks.broadcast_plan, plan)  # the other ranks, if any, take the step too
        dropped = await self._train_plan(plan, order, delivery)
        return TrainDone(order.batch_id, order.attempt, learner.version, dropped=tuple(dropped.items()))

    async def _unreadable(self, order: TrainOrder, group_ids: list[str]) -> dict[str, str]:
        """Why each of ``group_ids`` (of ``order``) cannot be read, if none of them can; else {}."""
        keys = [order.group_keys[order.group_ids.index(g)] for g in group_ids]
        records = await self.get_records_each(keys, GroupRecord, ready=True)
        if not all(isinstance(r, WorkRefused) for r in records):
            return {}
        return {g: _dropped_reason(str(r)) for g, r in zip(group_ids, records, strict=True)}

    async def _train_plan(self, plan: TrainPlan, order: TrainOrder | None = None,
                          delivery: Delivery | None = None) -> dict[str, str]:
        """One step on ``plan``, the same sequence on every rank; rank 0, which took the ``order`` (its
        ``delivery`` holds a lone rank's background upload), also writes the row, reports and releases.
        Returns the groups left out of the step (their record unreadable), each with why."""
        groups, dropped = await self._read_share(plan)
        learner = self.learner
        counted = (self.num_samples, self.busy_s)  # what the step adds, taken back if it is rolled back
        started = time.monotonic()
        metrics = await self._compute(learner.step, groups, plan.batch_id)
        try:
            await self._keep_step(metrics, [g.group_id for g in groups], started, order, delivery)
        except Exception as e:
            await self._back_to_stored(e, counted)
            raise
        return dropped

    async def _keep_step(self, metrics: StepMetrics, group_ids: list[str], started: float,
                         order: TrainOrder | None, delivery: Delivery | None) -> None:
        """What follows the step in memory: its records, checkpoint and weights in the store, its row."""
        learner = self.learner
        await self._store_trainer_logprobs(learner.trained_logprobs)
        row = None
        if order is not None:
            self.num_samples += metrics.num_samples
            row = self._row(metrics, order, group_ids, busy_s=self.busy_s + time.monotonic() - started)
            # The step's row is written before its checkpoint: a trainer killed between the checkpoint and
            # the metrics get it when it restarts (`_recover_pending_row`), once, and never twice.
            await self.ctx.blob.put(PENDING_ROW, json.dumps(row).encode())
        if learner.version % self.config.trainer.checkpoint_every == 0:
            await self._save_checkpoint()
        self.busy_s += time.monotonic() - started
        announced = self._announce_when_durable(self._submit_weights())
        if self.ranks.distributed:  # its gather is a collective: every rank meets it here, before the next step's
            await announced
        else:  # the upload runs in the background; the order is acked once the new version is announced
            assert delivery is not None, "a lone rank trains only the orders it takes"
            delivery.task_group.create_task(announced)
        if row is not None:
            await self._report(row)
            await self.ctx.blob.delete(PENDING_ROW)
        if order is not None and self.ctx.ready_samples is not None:  # trained: the object store's copies go
            await self.ctx.ready_samples.release(list(order.group_keys))

    async def _back_to_stored(self, error: Exception, counted: tuple[int, float]) -> None:
        """A write after the step failed (the store full past its bound, unavailable, the local cache full): the
        step in memory is not the trainer's state, the store's newest checkpoint is. A lone rank reloads it
        (weights, optimizer moments, version and ledger; no restart), so that a redelivered order is trained
        again, never answered "already trained" from a step nobody can load, and makes sure its version is
        stored and announced; the step's counts (``counted``: samples and busy time before it) go back with
        it, as its retraining counts them again. That is only when the stored checkpoint is the version before
        the step, or the step's own: an older one (``trainer.checkpoint_every`` > 1) lacks steps already
        acknowledged, whose loss (and the reuse of their version numbers for other weights) is a failure to
        say, not a recovery to log, so the trainer fails and restarts from storage, as before rollbacks. With
        ranks, the group fails and restarts together from the stored checkpoint."""
        stepped = self.learner.version
        if self.ranks.distributed:
            self.fail(f"version {stepped}: a write after the step failed on rank {self.layout.rank}: {error!r}; "
                      "the group restarts from its stored checkpoint")
            return
        try:
            names = await stored_checkpoints(self.ctx.blob)
        except Exception as e:
            self.fail(f"version {stepped} could not be stored ({error!r}) nor the stored checkpoints listed "
                      f"({e!r}); the restarted trainer resumes from the newest")
            raise
        stored = checkpoint_version(names[-1]) if names else 0  # none stored: the starting policy, version 0
        if stored < stepped - 1:
            self.fail(f"version {stepped}: a write after the step failed ({error!r}) and the newest stored checkpoint "
                      f"is version {stored} (trainer.checkpoint_every = {self.config.trainer.checkpoint_every}): "
                      f"versions {stored + 1}..{stepped - 1} were acknowledged but are in no checkpoint: going back "
                      f"to version {stored} loses them, a failure, not a recovery; the trainer restarts from it "
                      "(trainer.checkpoint_every = 1 keeps every acknowledged step in a checkpoint)")
            return
        log.error("trainer_step_rolled_back", version=stepped, error=repr(error), stored_version=stored,
                  consequence="reloading the newest stored checkpoint; the order is redelivered and trained again")
        try:
            await self.publisher.close()  # what it was given is published or failed; its delta base goes with it
            restored = await download_checkpoint(self.ctx.blob, names[-1], self.checkpoints) if names else None
            for cached in self.checkpoints.glob("step-*"):  # newer than the stored: never resumed from
                if restored is None or cached.name > restored.name:
                    shutil.rmtree(cached, ignore_errors=True)
            self.learner = await self._learner_from(restored)
            if self.learner.version < stepped:  # the step is not stored: it is trained, and counted, again
                self.num_samples, self.busy_s = counted
            await self._start_publisher()
            await self._recover_pending_row()
            await self._announce_current()
        except Exception as e:  # the memory is not to be trusted and the store cannot say better: start again
            self.fail(f"version {stepped} could not be stored ({error!r}) nor the stored checkpoint reloaded "
                      f"({e!r}); the restarted trainer resumes from it")
            raise
        log.info("trainer_restored", version=self.learner.version, rolled_back_from=stepped,
                 checkpoint=restored.name if restored is not None else "starting policy")

    async def _read_share(self, plan: TrainPlan) -> tuple[list[GroupRecord], dict[str, str]]:
        """The plan's groups that can be read, and why each other one cannot (missing, corrupt, another
        schema): only those are left out, the rest trains. This rank reads its share (all of them on one rank)
        and the group exchanges them, every rank the same answer, never a collective left unpaired. Refused
        (WorkRefused) when none can be read, or the records are not the groups the plan names."""
        share = list(self.ranks.share_of(len(plan.group_keys)))
        records = await self.get_records_each([plan.group_keys[i] for i in share], GroupRecord, ready=True)
        mine: dict[int, GroupRecord | str] = {i: r if isinstance(r, GroupRecord) else str(r)
                                              for i, r in zip(share, records, strict=True)}
        every = await self._collective(self.ranks.exchange, mine, len(plan.group_keys))
        dropped = {plan.group_ids[i]: _dropped_reason(r) for i, r in enumerate(every) if isinstance(r, str)}
        groups = [r for r in every if isinstance(r, GroupRecord)]
        named = [g.group_id for g in groups]
        if len(set(plan.group_ids)) != len(plan.group_ids) or named != [g for g in plan.group_ids if g not in dropped]:
            raise WorkRefused(f"batch {plan.batch_id} names groups {list(plan.group_ids)} but its records "
                              f"hold {named}")
        if not groups:
            raise WorkRefused(f"batch {plan.batch_id}: no group can be trained: "
                              + "; ".join(f"{g}: {why}" for g, why in dropped.items()))
        if dropped:
            log.warning("groups_left_out_of_batch", batch_id=plan.batch_id, dropped=dropped,
                        trained_group_ids=named)
        return groups, dropped

    async def _store_trainer_logprobs(self, records: list[TrainerLogprobs]) -> None:
        """The step's log-probs of its trained tokens, each sample's beside its other blobs (collected with its
        group), for the rollout viewer, which the event tells where they are. For people only: a store that
        fails here costs the viewer those samples, never the step."""
        if not records:
            return
        keys = {r.sample_id: trainer_logprobs_key(r.sample_id) for r in records}
        try:
            await gather_or_cancel(*(self.put_record(keys[r.sample_id], r) for r in records))
        except (BlobError, OSError) as e:  # a full disk was waited out below: this is past the store's bounds
            log.warning("trainer_logprobs_not_stored", version=records[0].version, error=repr(e),
                        sample_ids=sorted(keys), consequence="the rollout viewer shows no trainer log-probs for them")
            return
        log.info("trainer_logprobs_stored", version=records[0].version, keys=keys)

    async def _latest_checkpoint(self) -> Path | None:
        """The newest checkpoint in the run's store, fetched into the local cache; a run from before
        checkpoints were stored: the newest in the run directory's ``checkpoints/``."""
        names = await stored_checkpoints(self.ctx.blob)
        if names:
            return await download_checkpoint(self.ctx.blob, names[-1], self.checkpoints)
        return Learner.latest_checkpoint(self.checkpoints)

    async def _save_checkpoint(self) -> None:
        """Saves the learner (``Learner.save``, into the local cache) and stores it in the run's store:
        the step counts as checkpointed once the stored copy's manifest is written. With ranks, each rank
        saves its shard into the cache they share and rank 0, once all are written, stores the whole."""
        saved = await self._compute(self.learner.save, self.checkpoints)
        if self.layout.rank > 0:
            return
        await upload_checkpoint(self.ctx.blob, saved)
        await prune_checkpoints(self.ctx.blob, self.config.trainer.keep_checkpoints)

    async def _recover_pending_row(self) -> None:
        """The row of the step a killed trainer checkpointed but had not reported yet goes to the metrics
        now (a row of a step not checkpointed is dropped: that step is trained again, and its row
        replaces any row of its version)."""
        try:
            row = json.loads(await self.ctx.blob.get(PENDING_ROW))
        except BlobNotFound:
            return
        except ValueError:  # unreadable: its step is not trusted to be checkpointed either
            row = {}
        version = self.learner.version
        if row.get("version") == version and not await self.ctx.blob.exists(metrics_key("train", numbered(version))):
            await write_metrics(self.ctx.blob, "train", numbered(version), row)
            log.info("train_row_recovered", version=version, batch_id=row.get("batch_id"))
        await self.ctx.blob.delete(PENDING_ROW)

    def _submit_weights(self) -> tuple[int, asyncio.Future[PublishedVersion]]:
        """This rank's part of the learner's version (all of it on one rank) to the publisher: the step's whole
        share of publishing is one copy into recycled bf16 buffers; encoding and upload run in the background."""
        version = self.learner.version
        self.last_submitted = version
        part = weights_to_publish(self.learner.model, self.layout)
        return version, self.publisher.submit(version, self.publisher.snapshot(part))

    async def _announce_when_durable(self, submitted: tuple[int, asyncio.Future[PublishedVersion]]) -> None:
        """Waits for this rank's upload; rank 0 announces the version once every rank's part is durable. A
        version not durable everywhere is never announced: the newest fails the trainer (restarted, it
        publishes that version again); an older one is only logged, a newer one supersedes it (a lone rank's:
        a group waits for each version before its next step)."""
        version, future = submitted
        error: Exception | None = None
        published: PublishedVersion | None = None
        try:
            published = await future
        except Exception as e:  # said to the other ranks: nobody announces a version with a part missing
            error = e
        durable = await self._collective(self.ranks.gather, error is None)
        if published is None or not all(durable):
            failed = [r for r, ok in enumerate(durable) if not ok]
            if version < self.last_submitted:
                log.warning("weights_publish_failed", version=version, superseded_by=self.last_submitted,
                            ranks=failed, error=repr(error))
                return
            # The newest version would never reach anyone: fail loudly; the restarted trainer publishes it again.
            self.fail(f"publishing weights version {version} failed on ranks {failed}: {error!r}")
            raise error or RuntimeError(f"weights version {version} is not durable on ranks {failed}")
        if self.layout.rank > 0:
            return
        await self._announce(WeightsPublished(self.run_name, published.version, published.manifest_key,
                                              published.num_encoded_bytes))
        log.info("weights_announced", version=published.version, base_version=published.base_version,
                 world_size=self.layout.world_size, num_encoded_bytes=published.num_encoded_bytes,
                 num_weight_bytes=published.num_weight_bytes, encode_s=round(published.encode_s, 4),
                 upload_s=round(published.upload_s, 4))

    async def _announce(self, msg: WeightsPublished) -> None:
        await self.bus.publish(weights_subject(self.run_name), await self.signal_codec.encode(msg))
        await self.bus.flush(timeout_s=5.0)  # sent now, not with the next batch of writes: rollouts may be waiting

    def _row(self, m: StepMetrics, order: TrainOrder, group_ids: list[str], *, busy_s: float) -> dict[str, Any]:
        wall = time.monotonic() - self.started_at
        return {"kind": "train", "time": time.time(), "batch_id": order.batch_id, "group_ids": group_ids,
                **m.to_dict(),
                "samples_per_s": self.num_samples / wall if wall > 0 else 0.0,
                "trainer_utilisation": busy_s / wall if wall > 0 else 0.0}

    async def _report(self, row: dict[str, Any]) -> None:
        await write_metrics(self.ctx.blob, "train", numbered(row["version"]), row)
        log.info("train_step", **{k: v for k, v in row.items() if k not in ("lag_histogram", "kind", "group_ids")})
        lag = f"{row['lag_min']}..{row['lag_max']}"
        progress = {"step": row["version"], "reward": round(row["reward_mean"], 3), "pass": round(row["pass_rate"], 3),
                    "lag": lag, "samples/s": round(row["samples_per_s"], 2),
                    "util": round(row["trainer_utilisation"], 2)}
        await self.bus.publish("progress.train", msgpack.packb(progress, use_bin_type=True))


def _dropped_reason(refusal: str) -> str:
    """What the reconciler records for a group left out of its batch."""
    return f"{refusal}; this group is dropped, the rest of its batch trains"
