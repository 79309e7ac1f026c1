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
from collections.abc import Sequence
from typing import Any

import structlog

from actors._stage import StageActor, WorkRefused
from actors.agent.episode import run_episode
from actors.agent.policy import load_policy, weights_run_name
from actors.agent.weights_follower import WeightsFollower, WeightsUnavailable
from actors.reconciler.slot import Stage
from actors.reconciler.work import RolloutDone, RolloutOrder
from actors.records import RolloutRecord
from actors.stages.scratch import open_sandbox_store
from actors.task_catalog import TaskCatalog
from model.engine import EngineStatus, GenerationEngine
from model.errors import EngineError, EngineStateError
from model.generation import EngineConfig, Generation, KVPolicy
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from runtime.actor import Delivery
from runtime.bus_auth import BusAccess
from sandbox import Environment, EnvironmentPool, PoolConfig, Snapshot, ToolBox
from sandbox.archive import export_snapshot_bytes
from sandbox.errors import SandboxViolation
from sandbox.tasks import Task

log = structlog.get_logger(__name__)

__all__ = ["RolloutActor"]


class RolloutActor(StageActor):
    bus_access = BusAccess(subscribe=("weights.*",))
    stage = Stage.ROLLOUT

    async def setup(self) -> None:
        cfg = self.config
        self.tasks = TaskCatalog.build(cfg.tasks)
        self.tokenizer = ByteTokenizer()
        self.run_name = weights_run_name(self.ctx.run_dir)
        policy = await asyncio.to_thread(load_policy, cfg.policy)  # may build the starting policy once
        self.engine = GenerationEngine(policy, EngineConfig(max_batch_size=cfg.rollout.max_batch_size),
                                       detokenize=self.tokenizer.decode)
        await self.engine.start()
        self.exit_stack.push_async_callback(self.engine.stop)
        self.store = open_sandbox_store(self.kind, self.ctx.run_dir, self.exit_stack)
        self.pool = EnvironmentPool(PoolConfig(warm_per_snapshot=cfg.rollout.warm_environments, max_snapshots=8))
        await self.pool.start()
        self.exit_stack.push_async_callback(self.pool.stop)
        self.bases: dict[str, Snapshot] = {}
        self.exit_stack.callback(self._release_bases)
        self.weights = WeightsFollower(self.bus, self.ctx.blob, self.run_name, self.engine,
                                       kv_policy=KVPolicy(cfg.rollout.kv_policy))
        await self.weights.start(self.exit_stack)
        await self.weights.load_latest()  # a restarted actor starts from the newest published version

    def _release_bases(self) -> None:
        for snapshot in self.bases.values():
            snapshot.release()

    async def background(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.weights.follow())

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
        if self.engine.version < order.policy_version_floor:  # admitted under a newer policy than ours
            await self._reach(order.policy_version_floor)
        env = await self.pool.acquire(self._base(task))
        try:
            toolbox = ToolBox(env)

            async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
                result = await toolbox.call(name, args)
                return result.ok, result.text

            r = self.config.rollout
            sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p,
                                      seed=_seed(order, self.ctx.run.seed if self.ctx.run else 0))
            traj = await run_episode(task, self._generate, call_tool, self.tokenizer, r.agent, sampling)
            workspace, violation = _export_workspace(env)
        finally:
            env.close()
        key = f"samples/{order.sample_id}/a{order.attempt}"
        if workspace is not None:
            await self.ctx.blob.put(f"{key}/workspace.tar.zst", workspace)
        else:  # the policy's doing, not a fault: the sample stands and the reward actor fails every test
            log.warning("rollout_workspace_over_budget", sample_id=order.sample_id, reason=violation)
        await self.put_record(f"{key}/trajectory", RolloutRecord(order.sample_id, order.prompt_id, traj, violation))
        log.info("rollout_finished", sample_id=order.sample_id, prompt_id=order.prompt_id, end=traj.end.value,
                 num_tokens=traj.num_tokens, num_turns=traj.num_turns, num_summaries=traj.num_summaries,
                 num_summary_tokens=traj.num_summary_tokens, min_version=traj.min_version,
                 max_version=traj.max_version, duration_s=round(traj.duration_s, 3))
        return RolloutDone(order.sample_id, order.attempt, key, traj.min_version, traj.max_version)


    async def _reach(self, version: int) -> None:
        """Wait for ``version`` in the engine; WeightsUnavailable (the order is nak'ed and comes back) after
        ``rollout.weights_wait_s``, or at once when the actor drains: nothing started, nothing to finish."""
        async with asyncio.TaskGroup() as tg:  # a reach that times out raises out of here (WeightsUnavailable)
            reached = tg.create_task(self.weights.reach(version, self.config.rollout.weights_wait_s))
            drained = tg.create_task(self._drain_requested.wait())
            await asyncio.wait((reached, drained), return_when=asyncio.FIRST_COMPLETED)
            in_time = reached.done()
            (drained if in_time else reached).cancel()
        if not in_time:
            raise WeightsUnavailable(f"draining while waiting for weights version {version}; the order goes back")

    async def probe(self) -> None:
        """Health: the engine decodes one token now (a dead or wedged engine fails it, the process alive)."""
        generation = await self._generate(self.tokenizer.encode("ok"),
                                          SamplingParams(max_new_tokens=1, temperature=0))
        if len(generation.token_ids) != 1:
            raise RuntimeError(f"the engine decoded {len(generation.token_ids)} tokens for one asked")

    async def _generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """The engine's generate; an engine that FAILED fails this actor: every later call would raise,
        so the process exits (in-flight orders nak'ed, redelivered) and its supervisor starts a new one."""
        try:
            return await self.engine.generate(prompt_ids, params)
        except (EngineError, EngineStateError) as e:
            if self.engine.status is EngineStatus.FAILED:
                self.fail(f"the generation engine failed: {e}")
            raise


def _export_workspace(env: Environment) -> tuple[bytes | None, str]:
    """The finished workspace as an archive, or None and the reason when the policy took it over the
    sandbox's host budgets (bytes, inodes, depth): a sample like any other, which fails every test."""
    try:
        snapshot = env.snapshot()
        try:
            return export_snapshot_bytes(snapshot), ""
        finally:
            snapshot.release()
    except SandboxViolation as e:
        return None, str(e)


def _seed(order: RolloutOrder, run_seed: int) -> int:
    """Sampling seed of one attempt: reproducible for a run seed, different across attempts and runs."""
    digest = hashlib.sha256(f"{run_seed}/{order.sample_id}/{order.attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big")
