"""Self-summarization chains in the agent loop: where summaries fall, what the next segment starts from,
which tokens are the policy's, and that the token budget, the turn budget and the timeout still end chains."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
import torch

from actors.agent.config import END, AgentConfig
from actors.agent.dialect import Dialect
from actors.agent.episode import resume_prompt_text, run_episode, summary_request_text, task_prompt_text
from actors.agent.trajectory import EpisodeEnd, Trajectory
from actors.training.reference_chains import LONG_CONTEXT_AGENT, ReferencePolicy, reference_chain
from model.generation import FinishReason, Generation
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from runtime.errors import ConfigError
from sandbox.long_context_tasks import generate_long_context_tasks
from sandbox.tasks import Task

TOKENIZER = ByteTokenizer()
TASK = generate_long_context_tasks(0, 1)[0]


def _run(task: Task, policy: ReferencePolicy | object, config: AgentConfig) -> Trajectory:
    async def call_tool(name: str, args: dict) -> tuple[bool, str]:
        if name == "read_file":
            return True, task.files[args["path"]]
        return True, f"wrote {len(args['content'].encode())} bytes to {args['path']}"

    return asyncio.run(run_episode(task, policy.generate, call_tool, Dialect.compact(), config,  # type: ignore[attr-defined]
                                   SamplingParams(temperature=0.0)))


def _consistent(traj: Trajectory) -> None:
    for seg in traj.segments:
        n = len(seg.token_ids)
        assert (len(seg.loss_mask), len(seg.behaviour_logprobs), len(seg.logprob_temperatures),
                len(seg.versions)) == (n, n, n, n)
        assert seg.topk_ids_TLK is not None and seg.topk_ids_TLK.shape[0] == n


def test_a_chain_summarizes_when_the_window_would_fill_and_resumes_from_task_and_summary() -> None:
    chain = reference_chain(TASK)
    assert chain.end is EpisodeEnd.FINAL_ANSWER and chain.num_summaries == 2 and len(chain.segments) == 3
    assert chain.num_turns == 5  # three reads, the write, done: summaries are not turns
    _consistent(chain)
    request = TOKENIZER.encode(summary_request_text(LONG_CONTEXT_AGENT))
    for before, after in zip(chain.segments, chain.segments[1:], strict=False):
        k = before.summary_len
        summary = before.token_ids[-k:]
        assert k > 0 and summary[-1] == TOKENIZER.end_token_id
        assert before.loss_mask[-k:] == [1] * k, "the summary is the policy's: trained where it is written"
        r = len(request)
        assert before.token_ids[-k - r:-k] == request and before.loss_mask[-k - r:-k] == [0] * r
        head, tail = resume_prompt_text(TASK, "\x00", LONG_CONTEXT_AGENT).split("\x00")
        expected = TOKENIZER.encode(head) + summary[:-1] + TOKENIZER.encode(tail)
        assert after.token_ids[:after.prompt_len] == expected, "the next segment: task prompt + the summary's ids"
        assert after.loss_mask[:after.prompt_len] == [0] * after.prompt_len, "the summary trains once, not twice"
        assert len(before.token_ids) <= LONG_CONTEXT_AGENT.max_total_tokens
    assert chain.segments[-1].summary_len == 0
    assert chain.num_summary_tokens == sum(s.summary_len for s in chain.segments)
    assert chain.segments[0].token_ids[:chain.segments[0].prompt_len] == TOKENIZER.encode(task_prompt_text(TASK))


def test_without_summaries_the_window_ends_the_same_task_on_its_token_budget() -> None:
    off = dataclasses.replace(LONG_CONTEXT_AGENT, summarize_at_tokens=0)
    chain = _run(TASK, ReferencePolicy(TASK, off), off)
    assert chain.end is EpisodeEnd.TOKEN_BUDGET and len(chain.segments) == 1 and chain.num_summaries == 0
    assert '"name":"write_file"' not in TOKENIZER.decode(chain.policy_token_ids), "the answer never fit"
    assert chain.num_summary_tokens == 0 and chain.segments[0].summary_len == 0


class Reader:
    """Reads the first note again and again: a chain that never finishes by itself."""

    def __init__(self, request: str, delay_summary_s: float = 0.0) -> None:
        self.request = request
        self.delay_summary_s = delay_summary_s
        self.calls = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.calls += 1
        summary = TOKENIZER.decode(prompt_ids).endswith(self.request)
        if summary and self.delay_summary_s:
            await asyncio.sleep(self.delay_summary_s)
        text = "read it" + END if summary else '<tool>{"name":"read_file","args":{"path":"notes/1.txt"}}</tool>'
        ids = TOKENIZER.encode(text)[: params.max_new_tokens]
        topk = torch.zeros((len(prompt_ids) + len(ids), 1, 1), dtype=torch.int16)
        return Generation(tuple(prompt_ids), tuple(ids), (-0.5,) * len(ids), (7,) * len(ids), topk,
                          FinishReason.STOP_STRING)


def test_the_token_budget_ends_a_chain_once_its_summaries_are_spent() -> None:
    config = dataclasses.replace(LONG_CONTEXT_AGENT, max_turns=100, max_summaries=2)
    chain = _run(TASK, Reader(summary_request_text(config)), config)
    assert chain.end is EpisodeEnd.TOKEN_BUDGET and chain.num_summaries == 2 and len(chain.segments) == 3
    assert all(len(s.token_ids) <= config.max_total_tokens + config.tool_output_max_chars + 16 for s in chain.segments)
    _consistent(chain)


def test_the_turn_budget_counts_turns_over_the_whole_chain() -> None:
    config = dataclasses.replace(LONG_CONTEXT_AGENT, max_turns=4)
    chain = _run(TASK, ReferencePolicy(TASK, config), config)
    assert chain.end is EpisodeEnd.TURN_BUDGET and chain.num_turns == 4 and chain.num_summaries == 1
    assert len(chain.tool_uses) == 4
    _consistent(chain)


def test_the_timeout_ends_a_chain_while_the_policy_summarizes() -> None:
    # the reads before the summary take microseconds; the summary never comes within the 3 s timeout
    config = dataclasses.replace(LONG_CONTEXT_AGENT, max_turns=100, episode_timeout_s=3.0)
    policy = Reader(summary_request_text(config), delay_summary_s=120.0)
    chain = _run(TASK, policy, config)
    assert chain.end is EpisodeEnd.TIMEOUT and chain.num_summaries == 0 and chain.duration_s < 60
    _consistent(chain)
    seg = chain.segments[0]  # the request is there, no summary: nothing half-written
    assert TOKENIZER.decode(seg.token_ids).endswith(summary_request_text(config)) and seg.summary_len == 0


def test_a_summary_the_window_has_no_room_for_ends_the_chain_on_its_token_budget() -> None:
    # threshold past the window: the request lands after the window is already full
    config = dataclasses.replace(LONG_CONTEXT_AGENT, max_turns=100, summarize_at_tokens=10_000, max_total_tokens=400)
    chain = _run(TASK, Reader(summary_request_text(config)), config)
    assert chain.end is EpisodeEnd.TOKEN_BUDGET and chain.num_summaries == 0


def test_summaries_off_is_todays_episode() -> None:
    # summarize_at_tokens = 0 or max_summaries = 0: one segment, whatever the context
    for config in (AgentConfig(max_turns=100), AgentConfig(max_turns=100, summarize_at_tokens=100, max_summaries=0)):
        chain = _run(TASK, Reader(summary_request_text(config)), config)
        assert len(chain.segments) == 1 and chain.end is EpisodeEnd.TOKEN_BUDGET


@pytest.mark.parametrize("bad", ["<|end|>", "fine<|user|>", "<|assistant|>x"])
def test_a_summary_template_with_role_markers_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="summary_prompt"):
        AgentConfig(summary_prompt=bad)
    with pytest.raises(ConfigError, match="summary_header"):
        AgentConfig(summary_header=bad)
