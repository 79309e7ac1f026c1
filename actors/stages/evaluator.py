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
import contextlib
import time
from typing import ClassVar

import msgpack
import structlog

from actors.agent.policy import load_run_policy_and_dialect
from actors.agent.weights_follower import WeightsFollower
from actors.config import RLConfig
from actors.messages import DataExhausted, data_exhausted_subject
from actors.reconciler.data_exhaustion import why_not_exhausted
from actors.reconciler.kv_store import KVSlotStore
from actors.run_end import finish_request
from actors.stages.evaluator_role import EvaluatorRole
from actors.stages.scratch import open_sandbox_store
from actors.task_catalog import TaskCatalog
from actors.training.evaluation import evaluate, greedy, sampled
from actors.weights_announcements import weights_run_name
from model.engine import GenerationEngine
from model.generation import EngineConfig
from model.weight_sync import WeightSyncError
from runtime.bus import Inbound
from runtime.codec import Codec
from runtime.errors import BusError
from runtime.metrics_log import numbered, read_metrics, write_metrics
from runtime.supervisor import FINISH_SUBJECT

log = structlog.get_logger(__name__)

__all__ = ["EvaluatorActor"]


class EvaluatorActor(EvaluatorRole):
    Config = RLConfig
    # A refused (or unanswered) finish is asked again by the clock: after the last version no newer one comes
    # to wake the loop. A check out of time or a bus electing a leader clears within seconds; a state that
    # still disagrees (a row not yet readable) is asked about less and less often, at most a minute apart.
    finish_retry_first_s: ClassVar[float] = 1.0
    finish_retry_max_s: ClassVar[float] = 60.0

    async def setup(self) -> None:
        catalog = TaskCatalog.build(self.config.tasks)
        self.tasks, self.train_source = catalog.heldout, catalog
        self.run_name = weights_run_name(self.ctx)
        policy, self.dialect = await load_run_policy_and_dialect(self.ctx, self.config.policy)
        self.engine = GenerationEngine(policy, EngineConfig(max_batch_size=self.config.eval.concurrency),
                                       detokenize=self.dialect.tokenizer.decode)
        await self.engine.start()
        self.exit_stack.push_async_callback(self.engine.stop)
        self.store = open_sandbox_store(self.kind, self.ctx.run_dir, self.exit_stack)
        self.evaluated = {int(r["version"]) for r in await read_metrics(self.ctx.blob, kind="eval")}
        self.weights = WeightsFollower(self.bus, self.ctx.blob, self.run_name, self.engine)
        await self.weights.start(self.exit_stack)
        self.exhausted_at: int | None = None  # the last version, once the reconciler says the data ran out
        self.finish_requested = False
        self.num_finish_requests = 0  # asked of the supervisor by this process (each refusal asked again)
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
            retry_in = await self._finish_if_last_evaluated()
            if retry_in is None:
                await self.weights.changed()
                continue
            with contextlib.suppress(TimeoutError):  # a newer version, or the time to ask again
                async with asyncio.timeout(retry_in):
                    await self.weights.changed()

    async def _finish_if_last_evaluated(self) -> float | None:
        """The run's last version is evaluated (just now, or before this process was restarted: its row
        is in the metrics): ask the supervisor to finish the run, until it is believed. Returns in how many
        seconds to ask again after a refusal or no answer; None: nothing to ask, or believed."""
        last = self.last_version
        if last is None or self.finish_requested or not any(v >= last for v in self.evaluated):
            return None
        reason = "steps" if last >= self.ctx.run_steps > 0 else "data exhausted"
        version = max(v for v in self.evaluated if v >= last)
        self.num_finish_requests += 1
        if self.num_finish_requests == 1:
            log.info("run_last_version_evaluated", version=last, steps=self.ctx.run_steps, reason=reason)
        try:
            reply = msgpack.unpackb(await self.bus.request(
                FINISH_SUBJECT, msgpack.packb(finish_request(self.identity.actor_id, version, reason)),
                timeout_s=35.0), raw=False)
            error = None if reply.get("ok") else str(reply.get("error"))
        except BusError as e:  # no supervisor answered (restarting, the bus electing a leader): ask again too
            error = f"the supervisor did not answer: {e!r}"
        if error is None:
            self.finish_requested = True
            log.info("run_finish_believed", version=version, attempt=self.num_finish_requests)
            return None
        retry_in = min(self.finish_retry_max_s, self.finish_retry_first_s * 2 ** min(self.num_finish_requests - 1, 16))
        log.error("run_finish_refused", version=version, attempt=self.num_finish_requests, retry_in_s=retry_in,
                  error=error, fix="the supervisor's run_finish_refused event says why; asked again in retry_in_s")
        return retry_in

    async def _evaluate(self, version: int) -> None:
        e = self.config.eval
        sampling = greedy() if e.temperature == 0 else sampled(e.temperature)

        async def on_progress(num_graded: int, num_episodes: int) -> None:
            await self._publish_progress(version, num_graded, num_episodes)

        result = await evaluate(self.engine, self.tasks, sampling=sampling, agent_config=self.config.rollout.agent,
                                concurrency=e.concurrency, store=self.store, dialect=self.dialect,
                                samples_per_task=e.samples_per_task, on_progress=on_progress)
        summary = result.summary()
        row = {"kind": "eval", "time": time.time(), "version": version, "temperature": e.temperature, **summary}
        await write_metrics(self.ctx.blob, "eval", numbered(row["version"]), row)
        self.evaluated.add(version)
        log.info("heldout_evaluated", version=version, **{k: v for k, v in summary.items() if k != "by_difficulty"})
        progress = {"heldout_pass@1": round(summary["pass_at_1"], 3), "eval_version": version}
        await self.bus.publish("progress.eval", msgpack.packb(progress, use_bin_type=True))

    async def _publish_progress(self, version: int, num_graded: int, num_episodes: int) -> None:
        """How far the evaluation of ``version`` is, on the run's progress line (``eval=v8 120/344``) and as an
        event: the final one takes minutes, and the line would otherwise sit at the last step meanwhile."""
        log.info("evaluation_progress", version=version, num_graded=num_graded, num_episodes=num_episodes)
        progress = {"eval": f"v{version} {num_graded}/{num_episodes}"}
        try:
            await self.bus.publish("progress.eval", msgpack.packb(progress, use_bin_type=True))
        except BusError as e:  # a line not shown is no reason to fail the evaluation it is about
            log.warning("evaluation_progress_not_published", version=version, error=str(e))
