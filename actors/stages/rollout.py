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
from actors.agent.policy import load_run_policy_and_dialect
from actors.agent.trajectory import Trajectory
from actors.agent.weights_follower import WeightsFollower, WeightsUnavailable
from actors.reconciler.slot import Stage
from actors.reconciler.work import RolloutDone, RolloutOrder
from actors.records import RolloutRecord
from actors.rollout_checkpoint import (
    NO_CHECKPOINT,
    CapturedCheckpoint,
    Resume,
    RolloutCheckpoints,
    num_policy_tokens,
)
from actors.stages.scratch import open_sandbox_store
from actors.task_catalog import TaskCatalog
from actors.weights_announcements import weights_run_name
from model.engine import EngineStatus, GenerationEngine
from model.errors import EngineError, EngineStateError
from model.generation import EngineConfig, Generation, KVPolicy
from model.sampling import SamplingParams
from runtime.actor import Delivery
from runtime.blob import BlobError
from runtime.bus_auth import BusAccess
from sandbox import Environment, EnvironmentPool, PoolConfig, Snapshot, ToolBox
from sandbox.archive import export_snapshot_bytes
from sandbox.errors import SandboxError, SandboxViolation
from sandbox.tasks import Task

log = structlog.get_logger(__name__)

__all__ = ["RolloutActor"]


class RolloutActor(StageActor):
    bus_access = BusAccess(subscribe=("weights.*",))
    stage = Stage.ROLLOUT

    async def setup(self) -> None:
        cfg = self.config
        self.tasks = TaskCatalog.build(cfg.tasks)
        self.run_name = weights_run_name(self.ctx)
        # may build the starting policy once
        policy, self.dialect = await load_run_policy_and_dialect(self.ctx, cfg.policy)
        self.engine = GenerationEngine(policy, EngineConfig(max_batch_size=cfg.rollout.max_batch_size),
                                       detokenize=self.dialect.tokenizer.decode)
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
        self.checkpoints = RolloutCheckpoints(self.ctx.blob)

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
        r = self.config.rollout
        resume = Resume(None)
        if r.checkpoints and (order.attempt > 0 or delivery.num_delivered > 1):  # work of an earlier try may exist
            resume = await self._find_checkpoint(order)
        env, resume = await self._environment(task, resume, order)
        progress = _CheckpointProgress()
        delays = _EnvironmentDelays()
        try:
            toolbox = ToolBox(env)

            async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
                result = await toolbox.call(name, args)
                # read at each call: tasks.latency is live; keyed by the call's place in the episode
                key = f"tool/{order.sample_id}/a{order.attempt}/{delays.num_calls}"
                delays.add(await self.environment_delay(self.config.tasks.latency.tool(), key))
                return result.ok, result.text

            run_seed = self.ctx.run.seed if self.ctx.run else 0
            seed = resume.checkpoint.seed if resume.checkpoint else _seed(order, run_seed)
            sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, seed=seed)

            async def on_turn(traj: Trajectory) -> None:
                if not self.config.rollout.checkpoints:
                    return
                captured = self.checkpoints.capture(sample_id=order.sample_id, prompt_id=order.prompt_id,
                                                    attempt=order.attempt, seed=seed, trajectory=traj, env=env)
                if captured is not None:  # written beside the episode (finished before the order is acked)
                    delivery.task_group.create_task(progress.write(captured))

            start = resume.checkpoint.trajectory if resume.checkpoint else None
            # counted now: the episode takes the checkpoint's transcript over and appends to it
            num_resumed_turns, num_resumed = resume.num_turns, num_policy_tokens(start) if start else 0
            traj = await run_episode(task, self._generate, call_tool, self.dialect, r.agent, sampling,
                                     start=start, on_turn=on_turn)
            workspace, violation = _export_workspace(env)
        finally:
            env.close()
        key = f"samples/{order.sample_id}/a{order.attempt}"
        if workspace is not None:
            await self.ctx.blob.put(f"{key}/workspace.tar.zst", workspace)
        else:  # the policy's doing, not a fault: the sample stands and the reward actor fails every test
            log.warning("rollout_workspace_over_budget", sample_id=order.sample_id, reason=violation)
        await self.put_record(f"{key}/trajectory", RolloutRecord(order.sample_id, order.prompt_id, traj, violation))
        log.info("rollout_finished", sample_id=order.sample_id, attempt=order.attempt, prompt_id=order.prompt_id,
                 end=traj.end.value,
                 num_tokens=traj.num_tokens, num_turns=traj.num_turns, num_summaries=traj.num_summaries,
                 num_summary_tokens=traj.num_summary_tokens, min_version=traj.min_version,
                 max_version=traj.max_version, duration_s=round(traj.duration_s, 3),
                 num_generated_tokens=num_policy_tokens(traj) - num_resumed, num_resumed_tokens=num_resumed,
                 num_resumed_turns=num_resumed_turns, num_checkpoints=progress.num_written,
                 checkpoint_bytes=progress.num_bytes, checkpoint_s=round(progress.seconds, 4),
                 checkpoint_blocking_s=round(progress.blocking_s, 4), env_delay_s=round(delays.seconds, 3))
        return RolloutDone(order.sample_id, order.attempt, key, traj.min_version, traj.max_version)

    async def _find_checkpoint(self, order: RolloutOrder) -> Resume:
        """The checkpoint this attempt resumes from, or none, and why (`rollout_started_over`)."""
        eta = self.config.reconciler.scheduling.eta
        floor = max(order.policy_version_floor, self.engine.version)  # its new tokens are of this version at least
        try:
            resume = await self.checkpoints.newest(order.sample_id, order.prompt_id, order.attempt,
                                                   version_floor=floor, eta=eta)
        except (BlobError, OSError) as e:  # storage trouble costs the saved work, never the sample
            resume = Resume(None, reason=f"listing the checkpoints failed: {e!r}")
        if resume.checkpoint is None:  # none written is normal; checkpoints that could not be used are said louder
            say = log.info if resume.reason == NO_CHECKPOINT else log.warning
            say("rollout_started_over", sample_id=order.sample_id, attempt=order.attempt, reason=resume.reason)
        return resume

    async def _environment(self, task: Task, resume: Resume, order: RolloutOrder) -> tuple[Environment, Resume]:
        """The checkpoint's environment rebuilt from its snapshot, or a fresh one of the task (and then no
        checkpoint: one whose workspace cannot be rebuilt is not resumed from)."""
        if resume.checkpoint is not None:
            try:
                env = self.checkpoints.rebuild(self.store, resume.checkpoint, task.limits)
                log.info("rollout_resumed", sample_id=order.sample_id, attempt=order.attempt, key=resume.key,
                         from_attempt=resume.checkpoint.attempt, num_turns=resume.num_turns,
                         num_policy_tokens=num_policy_tokens(resume.checkpoint.trajectory),
                         min_version=resume.checkpoint.trajectory.min_version)
                return env, resume
            except (SandboxError, OSError) as e:
                log.warning("rollout_started_over", sample_id=order.sample_id, attempt=order.attempt,
                            reason=f"checkpoint {resume.key}'s workspace cannot be rebuilt: {e}")
        return await self.pool.acquire(self._base(task)), Resume(None)

    async def _reach(self, version: int) -> None:
        """Wait for ``version`` in the engine; WeightsUnavailable (the order is nak'ed and comes back) after
        ``rollout.weights_wait_s``, or at once when the actor drains: nothing started, nothing to finish."""
        # a reach that times out raises out of here (WeightsUnavailable)
        if not await self._unless_drained(self.weights.reach(version, self.config.rollout.weights_wait_s)):
            raise WeightsUnavailable(f"draining while waiting for weights version {version}; the order goes back")

    async def probe(self) -> None:
        """Health: the engine ends a step, or decodes one token now when it has nothing to do (a dead or wedged
        engine fails it, the process alive; a busy one on a large policy is not taken for a wedged one)."""
        await self.engine.check_alive(self.dialect.tokenizer.encode("ok"))

    async def _generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """The engine's generate; an engine that FAILED fails this actor: every later call would raise,
        so the process exits (in-flight orders nak'ed, redelivered) and its supervisor starts a new one."""
        try:
            return await self.engine.generate(prompt_ids, params)
        except (EngineError, EngineStateError) as e:
            if self.engine.status is EngineStatus.FAILED:
                self.fail(f"the generation engine failed: {e}")
            raise


class _CheckpointProgress:
    """What one attempt's checkpoints cost (reported with ``rollout_finished``: the ones written by then)."""

    def __init__(self) -> None:
        self.num_written, self.num_bytes, self.seconds, self.blocking_s = 0, 0, 0.0, 0.0

    async def write(self, captured: CapturedCheckpoint) -> None:
        written = await captured.write()
        if written is not None:
            self.num_written += 1
            self.num_bytes += written.num_bytes
            self.seconds += written.seconds
            self.blocking_s += written.blocking_s


class _EnvironmentDelays:
    """The delays one attempt's tool calls waited (tasks.latency), reported with ``rollout_finished``."""

    def __init__(self) -> None:
        self.num_calls, self.seconds = 0, 0.0

    def add(self, delay_s: float) -> None:
        self.num_calls += 1
        self.seconds += delay_s


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
