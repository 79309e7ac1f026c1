"""The reward actor: grade a finished rollout with its task's hidden tests, in a fresh fork.

    reward = pass fraction − length_coef · C(x) − malformed_call_penalty · (number of malformed calls)
    C(x)   = ((1 + k·x)^(1−q) − 1) / (k·(1−q)),   x = weighted count of the episode's tokens, calls and turns

A chain (self-summarization: actors.agent.episode) is graded once, on its final workspace, and its length
counts every segment: the trajectory's counters are the chain's, its summaries a term of their own.

Every component is recorded beside the reward, so a run's reward can always be taken apart.
"""

from __future__ import annotations

import structlog

from actors._stage import StageActor, WorkRefused
from actors.agent.trajectory import Trajectory
from actors.config import RewardSection
from actors.reconciler.slot import Stage
from actors.reconciler.work import RewardDone, RewardOrder
from actors.records import RewardBreakdown, RewardRecord, RolloutRecord, TestResult
from actors.stages.scratch import open_sandbox_store
from actors.task_catalog import TaskCatalog
from runtime.actor import Delivery
from sandbox import Environment, import_snapshot_bytes, score
from sandbox.errors import SandboxViolation, SnapshotFormatError
from sandbox.reward import TestOutcome, over_budget_outcome
from sandbox.tasks import Task

log = structlog.get_logger(__name__)

__all__ = ["RewardActor", "RewardBreakdown", "compute_reward", "length_penalty"]


def length_penalty(x: float, k: float, q: float) -> float:
    """C(x) = ((1 + kx)^(1−q) − 1) / (k(1−q)); C(0) = 0, C'(0) = 1, concave for q > 0."""
    return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


def compute_reward(traj: Trajectory, num_passed: int, num_tests: int, cfg: RewardSection) -> RewardBreakdown:
    x = (cfg.weight_thinking_tokens * traj.num_thinking_tokens
         + cfg.weight_tool_call_tokens * traj.num_tool_call_tokens
         + cfg.weight_tool_output_tokens * traj.num_tool_output_tokens
         + cfg.weight_final_tokens * traj.num_final_tokens
         + cfg.weight_tool_calls * len(traj.tool_uses)
         + cfg.weight_turns * traj.num_turns
         + cfg.weight_summary_tokens * traj.num_summary_tokens)
    pass_fraction = num_passed / num_tests if num_tests else 0.0
    length = cfg.length_coef * length_penalty(x, cfg.k, cfg.q)
    malformed = cfg.malformed_call_penalty * traj.num_malformed_calls
    return RewardBreakdown(pass_fraction, num_passed, num_tests, x, length, traj.num_malformed_calls, malformed,
                           pass_fraction - length - malformed)


class RewardActor(StageActor):
    stage = Stage.REWARD

    async def setup(self) -> None:
        self.tasks = TaskCatalog.build(self.config.tasks)
        self.store = open_sandbox_store(self.kind, self.ctx.run_dir, self.exit_stack)

    async def probe(self) -> None:
        """Health: one sandboxed command runs and says what it was told (the sandbox and its store work)."""
        with Environment.create(self.store, {"probe.txt": "ok\n"}) as env:
            result = await env.run("cat probe.txt")
        if result.exit_code != 0 or result.stdout != "ok\n":
            raise RuntimeError(f"a sandboxed cat exited {result.exit_code} with {result.stdout[:80]!r}")

    async def work(self, order: RewardOrder, delivery: Delivery) -> RewardDone:
        try:
            task = self.tasks.task(order.prompt_id)
        except KeyError as e:
            raise WorkRefused(str(e)) from None
        rollout = await self.get_record(f"{order.rollout_key}/trajectory", RolloutRecord)
        if rollout.sample_id != order.sample_id:
            raise WorkRefused(f"rollout record {order.rollout_key} is of sample {rollout.sample_id}, "
                              f"not {order.sample_id}")
        traj = rollout.trajectory
        if rollout.workspace_violation:  # the rollout's workspace went over its host budgets
            outcome = over_budget_outcome(task, rollout.workspace_violation)
        else:
            outcome = await self._score_workspace(order, task)
        # the test suite's own latency, rehearsed (tasks.latency): keyed by the graded rollout, not the attempt
        env_delay_s = await self.environment_delay(self.config.tasks.latency.test(), f"test/{order.rollout_key}")
        breakdown = compute_reward(traj, outcome.num_passed, outcome.num_total, self.config.reward)
        key = f"{order.rollout_key}/reward-a{order.attempt}"
        await self.put_record(key, RewardRecord(
            order.sample_id, order.prompt_id, order.rollout_key, breakdown.reward, breakdown,
            tuple(TestResult(d.name, d.passed) for d in outcome.details)))
        log.info("sample_rewarded", sample_id=order.sample_id, prompt_id=order.prompt_id, reward=breakdown.reward,
                 pass_fraction=breakdown.pass_fraction, length_penalty=breakdown.length_penalty,
                 num_malformed_calls=breakdown.num_malformed_calls, env_delay_s=round(env_delay_s, 3))
        return RewardDone(order.sample_id, order.attempt, key)

    async def _score_workspace(self, order: RewardOrder, task: Task) -> TestOutcome:
        try:
            workspace = await self.ctx.blob.get(f"{order.rollout_key}/workspace.tar.zst")
            snapshot = import_snapshot_bytes(self.store, workspace)
        except KeyError:
            raise WorkRefused(f"workspace of {order.rollout_key} is missing") from None
        except SnapshotFormatError as e:
            raise WorkRefused(f"workspace of {order.rollout_key} is corrupt: {e}") from None
        except SandboxViolation as e:  # an archive over the import budgets: the workspace that made it was too
            return over_budget_outcome(task, str(e))
        try:
            return await score(snapshot, task)
        finally:
            snapshot.release()
