"""The rollout actor: run agent episodes in sandboxes with the current policy, many at once.

All episodes of one process share one generation engine (continuous batching). New weights arrive
in flight: on ``weights.<run>`` the actor fetches and rebuilds the version in the background (the
delta chain of model.weight_sync) and hands it to the engine, which swaps it between two decode
steps; tokens after the swap carry the new version, and the KV-cache policy (``rollout.kv_policy``)
is applied and recorded per sequence.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from typing import Any

import structlog

from actors._stage import StageActor, WorkRefused
from actors.agent import run_episode
from actors.lifecycle_events import RolloutDone, RolloutOrder
from actors.messages import WeightsPublished
from actors.policy import load_policy, weights_run_name
from actors.slots import Stage
from actors.task_catalog import TaskCatalog
from model.engine import GenerationEngine
from model.generation import EngineConfig, KVPolicy
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from model.weight_sync import SubscriberConfig, WeightSubscriber, WeightSyncError
from runtime.actor import Delivery
from runtime.codec import Codec
from sandbox import Environment, EnvironmentPool, LayerStore, PoolConfig, SandboxConfig, Snapshot, ToolBox
from sandbox.archive import export_snapshot_bytes
from sandbox.tasks import Task

log = structlog.get_logger(__name__)

__all__ = ["RolloutActor", "weights_subject"]


def weights_subject(run: str) -> str:
    return f"weights.{run}"


class RolloutActor(StageActor):
    stage = Stage.ROLLOUT

    async def setup(self) -> None:
        cfg = self.config
        self.tasks = TaskCatalog.build(cfg.tasks)
        self.tokenizer = ByteTokenizer()
        self.run_name = weights_run_name(self.ctx.run_dir)
        self.subscriber = WeightSubscriber(self.ctx.blob, SubscriberConfig(run=self.run_name, workers=1))
        self.exit_stack.callback(self.subscriber.close)
        policy = await asyncio.to_thread(load_policy, cfg.policy)  # may build the starting policy once
        self.engine = GenerationEngine(policy, EngineConfig(max_batch_size=cfg.rollout.max_batch_size),
                                       detokenize=self.tokenizer.decode)
        await self.engine.start()
        self.exit_stack.push_async_callback(self.engine.stop)
        root = self.exit_stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-", dir="/var/tmp"))
        self.store = LayerStore(SandboxConfig(root_dir=root))
        self.exit_stack.callback(self.store.close)
        self.pool = EnvironmentPool(PoolConfig(warm_per_snapshot=cfg.rollout.warm_environments, max_snapshots=8))
        await self.pool.start()
        self.exit_stack.push_async_callback(self.pool.stop)
        self.bases: dict[str, Snapshot] = {}
        self.exit_stack.callback(self._release_bases)
        self.latest_version = await self.subscriber.latest_version() or 0
        self.weights_changed = asyncio.Event()
        self.weights_lock = asyncio.Lock()
        self.weights_codec = Codec([WeightsPublished])
        sub = await self.bus.nc.subscribe(weights_subject(self.run_name), cb=self._on_weights)
        self.exit_stack.push_async_callback(sub.unsubscribe)
        await self._load_weights()  # a restarted actor starts from the newest published version

    def _release_bases(self) -> None:
        for snapshot in self.bases.values():
            snapshot.release()

    async def background(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self._weights_loop())

    async def _on_weights(self, raw: Any) -> None:
        try:
            msg = await self.weights_codec.decode(raw.data)
        except ValueError as e:
            log.error("weights_signal_rejected", error=str(e))
            return
        if msg.version > self.latest_version:
            self.latest_version = msg.version
            self.weights_changed.set()

    async def _weights_loop(self) -> None:
        while True:
            await self.weights_changed.wait()
            self.weights_changed.clear()
            await self._load_weights()

    async def _load_weights(self) -> None:
        async with self.weights_lock:  # the weights loop and a catching-up rollout may both ask
            await self._load_latest()

    async def _load_latest(self) -> None:
        target = self.latest_version
        if target <= self.engine.version:
            return
        try:
            state = await self.subscriber.fetch(target)
        except WeightSyncError as e:  # corrupt or missing: keep the current weights, recover on a later anchor
            log.error("weights_fetch_failed", version=target, error=str(e))
            return
        policy = KVPolicy(self.config.rollout.kv_policy)
        await self.engine.update_weights(state, target, policy)
        log.info("weights_swapped", version=target, kv_policy=policy.value, engine=self.engine.stats().__dict__)

    def _base(self, task: Task) -> Snapshot:
        if task.id not in self.bases:
            with Environment.create(self.store, task.files, task.limits) as env:
                self.bases[task.id] = env.snapshot()
            self.pool.prewarm(self.bases[task.id])
            while len(self.bases) > 64:  # the oldest task's group is long finished
                old_id = next(iter(self.bases))
                self.pool.forget(self.bases[old_id])
                self.bases.pop(old_id).release()
        return self.bases[task.id]

    async def work(self, order: RolloutOrder, delivery: Delivery) -> RolloutDone:
        try:
            task = self.tasks.task(order.prompt_id)
        except KeyError as e:
            raise WorkRefused(str(e)) from None
        while self.engine.version < order.policy_version_floor:  # admitted under a newer policy than ours
            self.latest_version = max(self.latest_version, order.policy_version_floor)
            await self._load_weights()
            if self.engine.version < order.policy_version_floor:
                await asyncio.sleep(0.5)
        env = await self.pool.acquire(self._base(task))
        try:
            toolbox = ToolBox(env)

            async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
                result = await toolbox.call(name, args)
                return result.ok, result.text

            r = self.config.rollout
            sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p,
                                      seed=_seed(order, self.ctx.run.seed if self.ctx.run else 0))
            traj = await run_episode(task, self.engine.generate, call_tool, self.tokenizer, r.agent, sampling)
            snapshot = env.snapshot()
            try:
                workspace = export_snapshot_bytes(snapshot)
            finally:
                snapshot.release()
        finally:
            env.close()
        key = f"samples/{order.sample_id}/a{order.attempt}"
        await self.ctx.blob.put(f"{key}/workspace.tar.zst", workspace)
        await self.put_record(f"{key}/trajectory", {"sample_id": order.sample_id, "prompt_id": order.prompt_id,
                                                    "trajectory": traj.to_dict()})
        log.info("rollout_finished", sample_id=order.sample_id, prompt_id=order.prompt_id, end=traj.end.value,
                 num_tokens=len(traj.token_ids), num_turns=traj.num_turns, min_version=traj.min_version,
                 max_version=traj.max_version, duration_s=round(traj.duration_s, 3))
        return RolloutDone(order.sample_id, order.attempt, key, traj.min_version, traj.max_version)


def _seed(order: RolloutOrder, run_seed: int) -> int:
    """Sampling seed of one attempt: reproducible for a run seed, different across attempts and runs."""
    digest = hashlib.sha256(f"{run_seed}/{order.sample_id}/{order.attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big")
