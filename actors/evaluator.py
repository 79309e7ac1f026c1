"""The evaluator actor: held-out pass@1 of the policy at the start, every few versions, and at the end.

It follows ``weights.<run>`` like a rollout actor (same delta path), evaluates version 0 before
training moves, then every ``eval.every_versions`` versions and the run's last version; each result
is a ``{"kind": "eval"}`` row in metrics.jsonl and a progress line. A run with a step budget is
finished by the evaluator once the last version is evaluated, so the final figure is always there.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import structlog

from actors.config import RLConfig
from actors.evaluation import evaluate, greedy, sampled
from actors.messages import WeightsPublished
from actors.policy import load_policy, weights_run_name
from actors.rollout import weights_subject
from actors.task_catalog import TaskCatalog
from actors.trainer import append_metrics
from model.engine import GenerationEngine
from model.generation import EngineConfig
from model.tokenizer import ByteTokenizer
from model.weight_sync import SubscriberConfig, WeightSubscriber, WeightSyncError
from runtime.actor import Actor
from runtime.codec import Codec
from runtime.supervisor import SUPERVISOR_SUBJECT
from sandbox import LayerStore, SandboxConfig

log = structlog.get_logger(__name__)

__all__ = ["EvaluatorActor"]


class EvaluatorActor(Actor):
    kind = "evaluator"
    Config = RLConfig

    async def setup(self) -> None:
        import torch

        torch.set_num_threads(self.config.policy.torch_threads)
        self.tasks = TaskCatalog.build(self.config.tasks).heldout
        self.tokenizer = ByteTokenizer()
        self.run_name = weights_run_name(self.ctx.run_dir)
        self.metrics_path = Path(self.ctx.run_dir) / self.config.trainer.metrics_file
        self.subscriber = WeightSubscriber(self.ctx.blob, SubscriberConfig(run=self.run_name, workers=1))
        self.exit_stack.callback(self.subscriber.close)
        self.engine = GenerationEngine(await asyncio.to_thread(load_policy, self.config.policy),
                                       EngineConfig(max_batch_size=self.config.eval.concurrency),
                                       detokenize=self.tokenizer.decode)
        await self.engine.start()
        self.exit_stack.push_async_callback(self.engine.stop)
        root = self.exit_stack.enter_context(tempfile.TemporaryDirectory(prefix="eval-", dir="/var/tmp"))
        self.store = LayerStore(SandboxConfig(root_dir=root))
        self.exit_stack.callback(self.store.close)
        self.evaluated = {int(r["version"]) for r in _eval_rows(self.metrics_path)}
        self.latest = 0
        self.changed = asyncio.Event()
        self.codec = Codec([WeightsPublished])
        sub = await self.bus.nc.subscribe(weights_subject(self.run_name), cb=self._on_weights)
        self.exit_stack.push_async_callback(sub.unsubscribe)
        self.latest = await self.subscriber.latest_version() or 0
        self.changed.set()

    async def _on_weights(self, raw: Any) -> None:
        msg = await self.codec.decode(raw.data)
        self.latest = max(self.latest, msg.version)
        self.changed.set()

    def _due(self, version: int) -> bool:
        steps = self.ctx.run.steps if self.ctx.run else 0
        every = max(1, self.config.eval.every_versions)
        return version not in self.evaluated and (version % every == 0 or (steps and version >= steps))

    async def background(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            target = self.latest
            if not self._due(target):
                continue
            if target != self.engine.version:
                try:
                    await self.engine.update_weights(await self.subscriber.fetch(target), target)
                except WeightSyncError as e:
                    log.error("eval_weights_fetch_failed", version=target, error=str(e))
                    continue
            await self._evaluate(target)
            steps = self.ctx.run.steps if self.ctx.run else 0
            if steps and target >= steps:
                log.info("run_step_budget_reached", version=target, steps=steps)
                await self.bus.nc.request(f"{SUPERVISOR_SUBJECT}.finish",
                                          msgpack.packb({"by": self.identity.actor_id, "reason": "steps"}),
                                          timeout=5.0)

    async def _evaluate(self, version: int) -> None:
        e = self.config.eval
        sampling = greedy() if e.temperature == 0 else sampled(e.temperature)
        result = await evaluate(self.engine, self.tasks, sampling=sampling, agent_config=self.config.rollout.agent,
                                concurrency=e.concurrency, store=self.store, tokenizer=self.tokenizer,
                                samples_per_task=e.samples_per_task)
        summary = result.summary()
        row = {"kind": "eval", "time": time.time(), "version": version, **summary}
        await asyncio.to_thread(append_metrics, self.metrics_path, row)
        self.evaluated.add(version)
        log.info("heldout_evaluated", version=version, **{k: v for k, v in summary.items() if k != "by_difficulty"})
        progress = {"heldout_pass@1": round(summary["pass_at_1"], 3), "eval_version": version}
        await self.bus.nc.publish("progress.eval", msgpack.packb(progress, use_bin_type=True))


def _eval_rows(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "eval":
            rows.append(row)
    return rows
