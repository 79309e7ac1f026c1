"""The evaluator actor: held-out pass@1 of the policy at the start, every few versions, and at the end.

It follows ``weights.<run>`` like a rollout actor (same delta path), evaluates version 0 before
training moves, then every ``eval.every_versions`` versions and the run's last version; each result
is an eval row in the run's metrics (in its blob store: ``runtime.metrics_log``) and a progress line.
The last version is the step budget's (``run.steps``) or, when the dataset's last epoch ends first,
the one the reconciler names in its ``DataExhausted`` message; the evaluator finishes the run once it
has evaluated it, so the final figure is always there.

Every due version is evaluated, in order, whatever the evaluator's speed or restarts: a version
whose row is not in the metrics (an evaluation interrupted by a kill, or versions announced while
it was down or busy) is loaded exactly and evaluated before newer ones, as long as the store keeps
its weights (``weights_gc`` keeps the newest 16 versions and their chains).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import structlog

from actors.agent.policy import load_run_policy, weights_run_name
from actors.agent.weights_follower import WeightsFollower
from actors.config import RLConfig
from actors.messages import DataExhausted, data_exhausted_subject
from actors.reconciler.data_exhaustion import why_not_exhausted
from actors.reconciler.kv_store import KVSlotStore
from actors.run_end import finish_request, why_not_finished
from actors.stages.scratch import open_sandbox_store
from actors.task_catalog import TaskCatalog
from actors.training.evaluation import evaluate, greedy, sampled
from model.engine import GenerationEngine
from model.generation import EngineConfig
from model.tokenizer import ByteTokenizer
from model.weight_sync import WeightSyncError
from runtime.actor import Actor
from runtime.bus import Bus, Inbound
from runtime.bus_auth import BusAccess
from runtime.codec import Codec
from runtime.metrics_log import numbered, read_metrics, write_metrics
from runtime.supervisor import FINISH_SUBJECT

log = structlog.get_logger(__name__)

__all__ = ["EvaluatorActor"]


class EvaluatorActor(Actor):
    kind = "evaluator"
    bus_access = BusAccess(publish=("progress.eval", FINISH_SUBJECT),
                           subscribe=("weights.*", "data_exhausted.*"), kv_read=("slots",))
    Config = RLConfig

    async def setup(self) -> None:
        catalog = TaskCatalog.build(self.config.tasks)
        self.tasks, self.train_source = catalog.heldout, catalog
        self.tokenizer = ByteTokenizer()
        self.run_name = weights_run_name(self.ctx)
        self.engine = GenerationEngine(await load_run_policy(self.ctx, self.config.policy),
                                       EngineConfig(max_batch_size=self.config.eval.concurrency),
                                       detokenize=self.tokenizer.decode)
        await self.engine.start()
        self.exit_stack.push_async_callback(self.engine.stop)
        self.store = open_sandbox_store(self.kind, self.ctx.run_dir, self.exit_stack)
        self.evaluated = {int(r["version"]) for r in await read_metrics(self.ctx.blob, kind="eval")}
        self.weights = WeightsFollower(self.bus, self.ctx.blob, self.run_name, self.engine)
        await self.weights.start(self.exit_stack)
        self.exhausted_at: int | None = None  # the last version, once the reconciler says the data ran out
        self.finish_requested = False
        self.exhausted_codec = Codec([DataExhausted])
        self.slot_store = KVSlotStore(self.bus, "slots")  # read only: claims are checked against it
        self.num_rejected_claims = 0
        sub = await self.bus.subscribe(data_exhausted_subject(self.run_name), self._on_data_exhausted)
        self.exit_stack.push_async_callback(sub.unsubscribe)

    @property
    def last_version(self) -> int | None:
        """The run's last policy version, if known: the step budget's or the dataset's, whichever comes first."""
        ends = [v for v in (self.ctx.run_steps or None, self.exhausted_at) if v is not None]
        return min(ends, default=None)

    def _due(self, version: int) -> bool:
        every = max(1, self.config.eval.every_versions)
        last = self.last_version
        return version not in self.evaluated and (version % every == 0 or (last is not None and version >= last))

    async def _on_data_exhausted(self, raw: Inbound) -> None:
        try:
            msg = await self.exhausted_codec.decode(raw.data)
        except ValueError as e:
            log.error("data_exhausted_rejected", error=str(e))
            return
        if self.exhausted_at is not None:
            return
        reason = await why_not_exhausted(msg, run=self.run_name, store=self.slot_store, source=self.train_source,
                                         num_epochs=self.config.reconciler.num_epochs)
        if reason is not None:
            self.num_rejected_claims += 1
            log.warning("data_exhausted_rejected", version=msg.version, reason=reason,
                        num_rejected=self.num_rejected_claims)
            return
        log.info("run_data_exhausted", last_version=msg.version, steps=self.ctx.run_steps)
        self.exhausted_at = msg.version
        self.weights.recheck()  # the newest version, skipped as not due, may be the last one

    async def background(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self._evaluate_due_versions())

    async def _evaluate_due_versions(self) -> None:
        """On each announcement: every due version from the engine's up to the newest, oldest first."""
        unavailable: set[int] = set()
        while True:
            newest = self.weights.latest
            for version in range(self.engine.version, newest + 1):
                if not self._due(version) or version in unavailable:
                    continue
                try:
                    await self.weights.load(version)
                except WeightSyncError as e:  # collected by the store's retention: say so, do not wait for it
                    log.error("eval_version_unavailable", version=version, error=str(e))
                    unavailable.add(version)
                    continue
                await self._evaluate(version)
            await self._finish_if_last_evaluated()
            await self.weights.changed()

    async def _finish_if_last_evaluated(self) -> None:
        """The run's last version is evaluated (just now, or before this process was restarted: its row
        is in the metrics): ask the supervisor to finish the run, once per process."""
        last = self.last_version
        if last is None or self.finish_requested or not any(v >= last for v in self.evaluated):
            return
        reason = "steps" if last >= self.ctx.run_steps > 0 else "data exhausted"
        log.info("run_last_version_evaluated", version=last, steps=self.ctx.run_steps, reason=reason)
        version = max(v for v in self.evaluated if v >= last)
        reply = msgpack.unpackb(await self.bus.request(
            FINISH_SUBJECT, msgpack.packb(finish_request(self.identity.actor_id, version, reason)), timeout_s=35.0),
            raw=False)
        if not reply.get("ok"):  # the supervisor reads the table and the metrics: asked again on the next version
            log.error("run_finish_refused", version=version, error=reply.get("error"),
                      fix="see the supervisor's run_finish_refused event; the run goes on")
            return
        self.finish_requested = True

    @classmethod
    async def why_not_finished(cls, bus: Bus, blob: Any, run: Any, request: dict[str, Any]) -> str | None:
        return await why_not_finished(bus, blob, run, request)

    async def _evaluate(self, version: int) -> None:
        e = self.config.eval
        sampling = greedy() if e.temperature == 0 else sampled(e.temperature)
        result = await evaluate(self.engine, self.tasks, sampling=sampling, agent_config=self.config.rollout.agent,
                                concurrency=e.concurrency, store=self.store, tokenizer=self.tokenizer,
                                samples_per_task=e.samples_per_task)
        summary = result.summary()
        row = {"kind": "eval", "time": time.time(), "version": version, "temperature": e.temperature, **summary}
        await write_metrics(self.ctx.blob, "eval", numbered(row["version"]), row)
        self.evaluated.add(version)
        log.info("heldout_evaluated", version=version, **{k: v for k, v in summary.items() if k != "by_difficulty"})
        progress = {"heldout_pass@1": round(summary["pass_at_1"], 3), "eval_version": version}
        await self.bus.publish("progress.eval", msgpack.packb(progress, use_bin_type=True))

