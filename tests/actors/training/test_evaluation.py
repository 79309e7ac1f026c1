"""Held-out evaluation runs real episodes in real sandboxes and counts pass@1 and rewards correctly."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
import torch

from actors.agent.config import TOOL, AgentConfig
from actors.agent.episode import reference_episode_text
from actors.agent.trajectory import EpisodeEnd
from actors.training.evaluation import EpisodeResult, EvalResult, evaluate, greedy, progress_due, sampled
from model.config import ModelConfig
from model.generation import FinishReason, Generation
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from model.transformer import MoETransformer
from sandbox.layers import LayerStore
from sandbox.task_generator import generate_tasks
from sandbox.tasks import Task

TOKENIZER = ByteTokenizer()


def _tasks() -> list[Task]:
    """Two held-out tasks of each difficulty."""
    return [t for d in (1, 2, 3, 4) for t in generate_tasks(0, 2, "heldout", difficulties=[d])]


class ScriptedEngine:
    """Answers each task's first turn with `first_turn(task)` and the second with the final answer."""

    def __init__(self, tasks: Sequence[Task], first_turn: Callable[[Task], str]) -> None:
        self.tasks = tasks
        self.first_turn = first_turn
        self.num_calls = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.num_calls += 1
        text = TOKENIZER.decode(prompt_ids)
        task = next(t for t in self.tasks if t.prompt in text)
        reply = "done<|end|>" if TOOL in text else self.first_turn(task)
        ids = TOKENIZER.encode(reply)
        topk = torch.full((len(prompt_ids) + len(ids), 1, 1), -1, dtype=torch.int16)
        return Generation(
            tuple(prompt_ids), tuple(ids), (0.0,) * len(ids), (0,) * len(ids), topk, FinishReason.STOP_STRING
        )


def _reference_call(task: Task) -> str:
    return reference_episode_text(task)[1][0]


def _wrong_call(task: Task) -> str:
    """Valid Python that fails every case: f returns a list, no task expects one for these inputs."""
    arg = "a" if "list a" in task.prompt else "s" if "(s)" in task.prompt else "x"
    content = f"def f({arg}):\\n    return [None, 'wrong']\\n"
    return '<tool>{"name":"write_file","args":{"path":"solution.py","content":"' + content + '"}}</tool>'


async def test_reference_episodes_pass_everything(store: LayerStore) -> None:
    tasks = _tasks()
    engine = ScriptedEngine(tasks, _reference_call)
    said: list[tuple[int, int]] = []

    async def on_progress(num_graded: int, num_episodes: int) -> None:
        said.append((num_graded, num_episodes))

    result = await evaluate(engine, tasks, sampling=greedy(), store=store, concurrency=4, on_progress=on_progress)
    # how far it is, from before the first episode to the last graded (fewer than 20 episodes: each one)
    assert said == [(n, len(tasks)) for n in range(len(tasks) + 1)]
    assert result.num_tasks == len(tasks)
    assert result.pass_at_1 == 1.0 and result.mean_reward == 1.0
    assert sorted(result.by_difficulty) == [1, 2, 3, 4]
    assert all(r.pass_at_1 == 1.0 and r.num_tasks == 2 for r in result.by_difficulty.values())
    assert all(e.end is EpisodeEnd.FINAL_ANSWER and e.num_tool_calls == 1 for e in result.episodes)
    assert engine.num_calls == 2 * len(tasks)


async def test_empty_answer_scores_zero(store: LayerStore) -> None:
    tasks = _tasks()[:4]
    engine = ScriptedEngine(tasks, lambda task: "done<|end|>")
    result = await evaluate(engine, tasks, sampling=greedy(), store=store)
    assert result.pass_at_1 == 0.0 and result.mean_reward == 0.0
    assert all(e.num_tool_calls == 0 and e.num_tests == 5 for e in result.episodes)


async def test_pass_at_1_counts_tasks_and_difficulties(store: LayerStore) -> None:
    tasks = _tasks()
    solved = {t.id for i, t in enumerate(tasks) if i % 2 == 0}  # one task of each difficulty
    engine = ScriptedEngine(tasks, lambda t: _reference_call(t) if t.id in solved else _wrong_call(t))
    result = await evaluate(engine, tasks, sampling=greedy(), store=store, concurrency=3)
    assert result.pass_at_1 == 0.5 and result.mean_reward == 0.5
    assert all(r.pass_at_1 == 0.5 for r in result.by_difficulty.values())
    assert {e.task_id for e in result.episodes if e.passed} == solved


def test_partial_credit_aggregates() -> None:
    def ep(task_id: str, difficulty: int, sample: int, passed: int) -> EpisodeResult:
        return EpisodeResult(task_id, difficulty, sample, passed, 5, EpisodeEnd.FINAL_ANSWER, 10, 1, "")

    episodes = [ep("a", 1, 0, 5), ep("a", 1, 1, 3), ep("b", 2, 0, 0), ep("b", 2, 1, 5)]
    result = EvalResult.from_episodes(episodes, samples_per_task=2, duration_s=1.0)
    assert result.pass_at_1 == pytest.approx(0.5)  # each task passes in one of two samples
    assert result.mean_reward == pytest.approx(((1 + 0.6) / 2 + (0 + 1) / 2) / 2)
    assert result.by_difficulty[1].mean_reward == pytest.approx(0.8)
    assert result.summary()["by_difficulty"]["2"]["pass_at_1"] == 0.5


async def test_real_engine_runs_sandboxed_episodes(store: LayerStore) -> None:
    config = ModelConfig(
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
    )
    model = MoETransformer(config).init_weights(0)
    tasks = _tasks()[:3]
    agent = AgentConfig(max_turns=2, max_new_tokens_per_turn=12, max_total_tokens=200)
    first = await evaluate(model, tasks, sampling=sampled(seed=7), agent_config=agent, store=store, samples_per_task=2)
    second = await evaluate(model, tasks, sampling=sampled(seed=7), agent_config=agent, store=store, samples_per_task=2)
    assert len(first.episodes) == 6 and first.samples_per_task == 2
    assert first.pass_at_1 == 0.0  # an untrained model writes no solution
    assert all(e.num_tests == 5 and e.num_tokens > 12 for e in first.episodes)
    assert [e.final_text for e in first.episodes] == [e.final_text for e in second.episodes]  # seeded


async def test_rejects_bad_arguments(store: LayerStore) -> None:
    with pytest.raises(ValueError, match="at least one task"):
        await evaluate(ScriptedEngine([], _reference_call), [], sampling=greedy(), store=store)
    with pytest.raises(ValueError, match="concurrency"):
        await evaluate(ScriptedEngine([], _reference_call), _tasks(), sampling=greedy(), store=store, concurrency=0)


def test_progress_is_said_about_every_twentieth_of_the_episodes() -> None:
    """The final evaluation of the default run grades 344 episodes over minutes: a progress line every 5% of them
    (about every 8 s of a 2.7-minute evaluation), the start and the end included, not one an episode."""
    for num_episodes in (1, 7, 20, 21, 344, 1000):
        said = [n for n in range(num_episodes + 1) if progress_due(n, num_episodes)]
        assert said[0] == 0 and said[-1] == num_episodes
        assert len(said) <= 22, (num_episodes, said)
        assert max(b - a for a, b in itertools.pairwise(said)) <= -(-num_episodes // 20), num_episodes
