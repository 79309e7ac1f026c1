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

import msgpack
import structlog

from actors.config import RLConfig
from actors.evaluation import evaluate, greedy, sampled
from actors.metrics_log import read_metrics
from actors.policy import load_policy, weights_run_name
from actors.task_catalog import TaskCatalog
from actors.trainer import append_metrics
from actors.weights_follower import WeightsFollower
from model.engine import GenerationEngine
from model.generation import EngineConfig
from model.tokenizer import ByteTokenizer
from runtime.actor import Actor
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
        self.engine = GenerationEngine(await asyncio.to_thread(load_policy, self.config.policy),
                                       EngineConfig(max_batch_size=self.config.eval.concurrency),
                                       detokenize=self.tokenizer.decode)
        await self.engine.start()
        self.exit_stack.push_async_callback(self.engine.stop)
        root = self.exit_stack.enter_context(tempfile.TemporaryDirectory(prefix="eval-", dir="/var/tmp"))
        self.store = LayerStore(SandboxConfig(root_dir=root))
        self.exit_stack.callback(self.store.close)
        self.evaluated = {int(r["version"]) for r in read_metrics(self.metrics_path, kind="eval")}
        self.weights = WeightsFollower(self.bus, self.ctx.blob, self.run_name, self.engine)
        await self.weights.start(self.exit_stack)

    def _due(self, version: int) -> bool:
        steps = self.ctx.run_steps
        every = max(1, self.config.eval.every_versions)
        return version not in self.evaluated and (version % every == 0 or (steps and version >= steps))

    async def background(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.weights.follow(wanted=self._due, on_loaded=self._on_version))

    async def _on_version(self, version: int) -> None:
        """The engine holds ``version``, which is due: evaluate it; finish a run whose budget it ends."""
        await self._evaluate(version)
        steps = self.ctx.run_steps
        if steps and version >= steps:
            log.info("run_step_budget_reached", version=version, steps=steps)
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
        row = {"kind": "eval", "time": time.time(), "version": version, "temperature": e.temperature, **summary}
        await asyncio.to_thread(append_metrics, self.metrics_path, row)
        self.evaluated.add(version)
        log.info("heldout_evaluated", version=version, **{k: v for k, v in summary.items() if k != "by_difficulty"})
        progress = {"heldout_pass@1": round(summary["pass_at_1"], 3), "eval_version": version}
        await self.bus.nc.publish("progress.eval", msgpack.packb(progress, use_bin_type=True))

