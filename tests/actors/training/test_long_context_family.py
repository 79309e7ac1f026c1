"""The long-context task family: needs more than one window, is solvable with summaries, is graded by its
hidden tests in real sandboxes; its reference chains are what the real tools give, token for token."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from actors.agent.dialect import Dialect
from actors.agent.episode import run_episode
from actors.agent.trajectory import EpisodeEnd
from actors.config import TasksSection
from actors.task_catalog import TaskCatalog
from actors.training.evaluation import evaluate, greedy
from actors.training.reference_chains import LONG_CONTEXT_AGENT, ReferencePolicy, chain_sft_examples, reference_chain
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from sandbox.env import Environment
from sandbox.layers import LayerStore
from sandbox.long_context_tasks import (
    NOTE_PATHS,
    all_long_context_tasks,
    count_long_context_tasks,
    generate_long_context_tasks,
    note_facts,
)
from sandbox.task_generator import generate_tasks
from sandbox.tools import ToolBox


def test_the_family_is_stable_split_and_its_facts_make_the_answer() -> None:
    train, heldout = all_long_context_tasks("train"), all_long_context_tasks("heldout")
    assert len(train) + len(heldout) == 900 and not {t.id for t in train} & {t.id for t in heldout}
    assert count_long_context_tasks("heldout") == len(heldout) > 100
    assert generate_long_context_tasks(3, 10) == generate_long_context_tasks(3, 10)
    assert generate_long_context_tasks(3, 10) != generate_long_context_tasks(4, 10)
    for task in train[:50]:
        facts = note_facts(task)
        assert [p for p, _ in facts.keys] == list(NOTE_PATHS)
        assert f"return {facts.answer}" in task.reference_solution["solution.py"]
        for path, key in facts.keys:  # each note gives its key alone, on its last line
            assert task.files[path].endswith(f"key: {key}\n") and task.files[path].count("key:") == 1
    with pytest.raises(ValueError, match="holds"):
        generate_long_context_tasks(0, len(train) + 1)
    with pytest.raises(ValueError, match="not a long-context task"):
        note_facts(generate_tasks(0, 1)[0])


def test_the_run_config_selects_the_family() -> None:
    catalog = TaskCatalog.build(TasksSection(family="long_context", num_train=5, num_heldout=3))
    assert len(catalog.train) == 5 and all(t.id.startswith("notes-") for t in (*catalog.train, *catalog.heldout))
    with pytest.raises(ValueError, match="long-context family"):
        TasksSection(family="long_context", num_heldout=10_000)
    with pytest.raises(ValueError, match=r"tasks\.family"):
        TasksSection(family="novel")


async def _solve(task: Any, store: LayerStore, agent: Any) -> Any:
    return await evaluate(ReferencePolicy(task, agent), [task], sampling=greedy(), agent_config=agent, store=store,
                          concurrency=1)


async def test_the_family_needs_summaries_a_perfect_agent_passes_with_them_and_fails_without(
        store: LayerStore) -> None:
    off = dataclasses.replace(LONG_CONTEXT_AGENT, summarize_at_tokens=0)
    for task in generate_long_context_tasks(0, 3, "heldout"):
        on = await _solve(task, store, LONG_CONTEXT_AGENT)
        assert on.pass_at_1 == 1.0 and on.summary()["summaries_per_episode"] == 2
        (episode,) = on.episodes
        assert episode.end is EpisodeEnd.FINAL_ANSWER and episode.num_summary_tokens > 0
        without = await _solve(task, store, off)
        assert without.pass_at_1 == 0.0 and without.episodes[0].end is EpisodeEnd.TOKEN_BUDGET


async def test_a_reference_chain_is_what_the_real_tools_give_token_for_token(store: LayerStore) -> None:
    tokenizer = ByteTokenizer()
    for task in generate_long_context_tasks(1, 2):
        with Environment.create(store, task.files, task.limits) as env:
            tools = ToolBox(env)

            async def call_tool(name: str, args: dict[str, Any], tools: ToolBox = tools) -> tuple[bool, str]:
                result = await tools.call(name, args)
                return result.ok, result.text

            real = await run_episode(task, ReferencePolicy(task).generate, call_tool, Dialect.compact(),
                                     LONG_CONTEXT_AGENT, SamplingParams(temperature=0.0))
        simulated = await asyncio.to_thread(reference_chain, task)
        assert [s.token_ids for s in real.segments] == [s.token_ids for s in simulated.segments]
        assert [s.loss_mask for s in real.segments] == [s.loss_mask for s in simulated.segments]
        examples = chain_sft_examples(simulated)
        assert len(examples) == len(simulated.segments)
        assert ["".join(text for text, _ in ex) for ex in examples] == [tokenizer.decode(s.token_ids)
                                                                        for s in simulated.segments]
        trained = "".join(text for ex in examples for text, keep in ex if keep)
        assert trained == tokenizer.decode(simulated.policy_token_ids)
