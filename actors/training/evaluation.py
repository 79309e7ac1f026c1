"""Held-out evaluation: real episodes of the policy in real sandboxes, graded by the hidden tests.

Every task gets `samples_per_task` episodes (`actors.agent.run_episode`) on a `GenerationEngine`, each in
a fresh `sandbox.Environment` holding the task's starting files and driven through `sandbox.tools.ToolBox`;
the finished environment is graded with `sandbox.reward.score` (hidden tests in a fresh fork).

    pass@1       fraction of episodes whose hidden tests all pass (averaged per task, then over tasks)
    pass@k       the unbiased estimator over each task's episodes (`actors.training.pass_at_k`), for k = 1
                 and, as the samples allow, 10, 100 and samples_per_task; each with its standard error
                 over tasks
    mean reward  mean fraction of hidden tests passed

Sampled episodes are seeded from (seed, task index, sample index), so a result does not depend on the
order in which concurrent episodes reach the engine. An evaluation takes minutes (344 episodes: 45% of a
short run's wall time went to its final one), so it reports how far it is (`progress_due`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol

import structlog

from actors.agent.config import AgentConfig
from actors.agent.dialect import Dialect
from actors.agent.episode import run_episode
from actors.agent.trajectory import EpisodeEnd
from actors.training.pass_at_k import PassAtK, estimate_pass_at_k, reported_ks
from model.engine import EngineConfig, GenerationEngine
from model.generation import Generation
from model.sampling import SamplingParams
from model.transformer import MoETransformer
from sandbox.env import Environment
from sandbox.layers import LayerStore
from sandbox.reward import score
from sandbox.tasks import Task
from sandbox.tools import ToolBox

__all__ = ["DifficultyResult", "EpisodeResult", "EvalResult", "OnProgress", "SupportsGenerate", "evaluate", "greedy",
           "progress_due", "sampled"]

log = structlog.get_logger(__name__)

_SEED_STRIDE = 1_000_003
PROGRESS_STEPS = 20  # an evaluation reports its progress about this many times (every 5% of its episodes)

OnProgress = Callable[[int, int], Awaitable[None]]  # (episodes graded, episodes in all)


def progress_due(num_graded: int, num_episodes: int) -> bool:
    """Whether an evaluation says how far it is after ``num_graded`` of its ``num_episodes``: at its start, at
    every ``1/PROGRESS_STEPS`` of its episodes, and at its end (a line a step, not one an episode)."""
    step = math.ceil(num_episodes / PROGRESS_STEPS)
    return num_graded % step == 0 or num_graded == num_episodes


class SupportsGenerate(Protocol):
    """What evaluation needs from a running engine (a `GenerationEngine`, or a scripted stand-in)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...


def greedy() -> SamplingParams:
    """Greedy decoding (temperature 0)."""
    return SamplingParams(temperature=0.0)


def sampled(temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> SamplingParams:
    """The RL rollout settings (temperature 1, full nucleus by default), seeded."""
    return SamplingParams(temperature=temperature, top_p=top_p, seed=seed)


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
    """One graded episode."""

    task_id: str
    difficulty: int
    sample: int
    num_passed: int
    num_tests: int
    end: EpisodeEnd
    num_tokens: int
    num_tool_calls: int
    final_text: str
    num_summaries: int = 0
    num_summary_tokens: int = 0

    @property
    def reward(self) -> float:
        return self.num_passed / self.num_tests if self.num_tests else 0.0

    @property
    def passed(self) -> bool:
        return self.num_tests > 0 and self.num_passed == self.num_tests


@dataclasses.dataclass(frozen=True)
class DifficultyResult:
    num_tasks: int
    pass_at_1: float
    mean_reward: float


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Aggregates over tasks (each task weighs the same) and every episode behind them."""

    num_tasks: int
    samples_per_task: int
    pass_at_1: float
    mean_reward: float
    by_difficulty: dict[int, DifficultyResult]
    episodes: tuple[EpisodeResult, ...]
    duration_s: float
    pass_at_k: dict[int, PassAtK] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_episodes(cls, episodes: Sequence[EpisodeResult], samples_per_task: int, duration_s: float) -> EvalResult:
        per_task: dict[str, list[EpisodeResult]] = {}
        for ep in episodes:
            per_task.setdefault(ep.task_id, []).append(ep)
        rows = [
            (eps[0].difficulty, _mean([e.passed for e in eps]), _mean([e.reward for e in eps]))
            for eps in per_task.values()
        ]
        by_difficulty = {
            d: DifficultyResult(
                num_tasks=sum(r[0] == d for r in rows),
                pass_at_1=_mean([r[1] for r in rows if r[0] == d]),
                mean_reward=_mean([r[2] for r in rows if r[0] == d]),
            )
            for d in sorted({r[0] for r in rows})
        }
        counts = [(len(eps), sum(e.passed for e in eps)) for eps in per_task.values()]
        fewest = min((n for n, _ in counts), default=0)
        return cls(
            len(rows),
            samples_per_task,
            _mean([r[1] for r in rows]),
            _mean([r[2] for r in rows]),
            by_difficulty,
            tuple(episodes),
            duration_s,
            {k: estimate_pass_at_k(counts, k) for k in reported_ks(fewest)} if counts else {},
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready aggregates (no episodes)."""
        return {
            "num_tasks": self.num_tasks,
            "samples_per_task": self.samples_per_task,
            "pass_at_1": round(self.pass_at_1, 4),
            "pass_at_1_stderr": _rounded(self.pass_at_k[1].stderr) if 1 in self.pass_at_k else None,
            # the unbiased estimator (Chen et al., 2021) with its standard error over tasks, per reported k
            "pass_at_k": {str(k): {"value": round(p.value, 4), "stderr": _rounded(p.stderr)}
                          for k, p in self.pass_at_k.items()},
            "mean_reward": round(self.mean_reward, 4),
            "by_difficulty": {
                str(d): {
                    "num_tasks": r.num_tasks,
                    "pass_at_1": round(r.pass_at_1, 4),
                    "mean_reward": round(r.mean_reward, 4),
                }
                for d, r in self.by_difficulty.items()
            },
            # self-summarization (agent.summarize_at_tokens): how often the policy summarized, and how long
            "summaries_per_episode": round(_mean([e.num_summaries for e in self.episodes]), 4),
            "summary_tokens_per_summary": round(sum(e.num_summary_tokens for e in self.episodes)
                                                / max(1, sum(e.num_summaries for e in self.episodes)), 2),
            "duration_s": round(self.duration_s, 2),
        }


def _rounded(value: float) -> float | None:
    """4 places; None for NaN (one task has no spread), which JSON cannot carry."""
    return None if math.isnan(value) else round(value, 4)


def _mean(values: Sequence[float | bool]) -> float:
    return sum(values) / len(values) if values else 0.0


def _episode_sampling(sampling: SamplingParams, task_index: int, sample: int, samples_per_task: int) -> SamplingParams:
    if sampling.temperature == 0:
        return sampling
    base = 0 if sampling.seed is None else sampling.seed
    return dataclasses.replace(sampling, seed=base * _SEED_STRIDE + task_index * samples_per_task + sample)


async def _one_episode(
    engine: SupportsGenerate,
    store: LayerStore,
    task: Task,
    sample: int,
    sampling: SamplingParams,
    agent_config: AgentConfig,
    dialect: Dialect,
) -> EpisodeResult:
    env = Environment.create(store, task.files, task.limits)
    try:
        tools = ToolBox(env)

        async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
            result = await tools.call(name, args)
            return result.ok, result.text

        traj = await run_episode(task, engine.generate, call_tool, dialect, agent_config, sampling)
        outcome = await score(env, task)
    finally:
        env.close()
    generated = traj.policy_token_ids
    return EpisodeResult(
        task_id=task.id,
        difficulty=task.difficulty,
        sample=sample,
        num_passed=outcome.num_passed,
        num_tests=outcome.num_total,
        end=traj.end,
        num_tokens=traj.num_tokens,
        num_tool_calls=len(traj.tool_uses),
        final_text=dialect.tokenizer.decode(generated)[-200:],
        num_summaries=traj.num_summaries,
        num_summary_tokens=traj.num_summary_tokens,
    )


async def evaluate(
    policy: MoETransformer | SupportsGenerate,
    tasks: Sequence[Task],
    *,
    sampling: SamplingParams,
    agent_config: AgentConfig | None = None,
    concurrency: int = 32,
    samples_per_task: int = 1,
    store: LayerStore | None = None,
    dialect: Dialect | None = None,
    engine_config: EngineConfig | None = None,
    on_progress: OnProgress | None = None,
) -> EvalResult:
    """Run and grade `samples_per_task` episodes of every task.

    Args:
        policy: a model (a private `GenerationEngine` is started and stopped here) or a running engine
            (used as is; a `GenerationEngine` must have been built with `detokenize` for the tool-call stop).
        tasks: the tasks to evaluate (normally `generate_tasks(..., split="heldout")`).
        sampling: decoding settings; a sampled (temperature > 0) run seeds each episode from `sampling.seed`.
        agent_config: episode budgets (default `AgentConfig()`).
        concurrency: episodes in flight at once (they share the engine's batch).
        samples_per_task: episodes per task; pass@1 is their mean pass rate.
        store: the sandbox layer store (default: one opened and closed here).
        dialect: how episodes speak to the policy (default: the tiny policy's, `Dialect.compact`).
        engine_config: for the private engine (default: batch size = `concurrency`).
        on_progress: awaited with (episodes graded, episodes in all) when `progress_due`: (0, n) before the first
            episode, then about every 5% of them, and (n, n) once the last is graded.

    Raises:
        ValueError: no tasks, or `concurrency` / `samples_per_task` below 1.
    """
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    if concurrency < 1 or samples_per_task < 1:
        raise ValueError(f"concurrency={concurrency} and samples_per_task={samples_per_task} must be >= 1")
    agent_config = agent_config or AgentConfig()
    dialect = dialect or Dialect.compact()
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        if store is None:
            store = LayerStore()
            stack.callback(store.close)
        engine: SupportsGenerate
        if not isinstance(policy, MoETransformer):
            engine = policy
        else:
            private = GenerationEngine(
                policy, engine_config or EngineConfig(max_batch_size=concurrency), detokenize=dialect.tokenizer.decode
            )
            await private.start()
            stack.push_async_callback(private.stop)
            engine = private
        gate = asyncio.Semaphore(concurrency)
        num_episodes, num_graded = len(tasks) * samples_per_task, 0
        if on_progress is not None:
            await on_progress(0, num_episodes)

        async def guarded(index: int, task: Task, sample: int) -> EpisodeResult:
            nonlocal num_graded
            async with gate:
                params = _episode_sampling(sampling, index, sample, samples_per_task)
                episode = await _one_episode(engine, store, task, sample, params, agent_config, dialect)
            num_graded += 1
            if on_progress is not None and progress_due(num_graded, num_episodes):
                await on_progress(num_graded, num_episodes)
            return episode

        async with asyncio.TaskGroup() as group:
            futures = [
                group.create_task(guarded(i, t, s)) for i, t in enumerate(tasks) for s in range(samples_per_task)
            ]
    result = EvalResult.from_episodes([f.result() for f in futures], samples_per_task, time.monotonic() - started)
    log.info(
        "evaluation_finished",
        **{k: v for k, v in result.summary().items() if k != "by_difficulty"},
        temperature=sampling.temperature,
    )
    return result
