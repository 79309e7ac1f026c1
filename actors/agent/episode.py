"""The agent loop: one episode of the policy working on a task in a sandbox through tools.

This module is the single definition of what an episode looks like on the token level; rollouts,
held-out evaluation and the supervised starting policy all use it, so they can never drift apart. The
policy's `actors.agent.dialect` renders the turns (token in, token out: what the policy sampled is never
re-encoded); in the tiny policy's compact dialect an episode reads

    <|user|>{task prompt}<|end|><|assistant|>{turn}[<|end|><|tool|>{result}<|end|><|assistant|>{turn}...]

and in a pretrained checkpoint's, its own chat template with ``<tool_call>`` calls.

A turn is generated until the tool call's closing tag or the end token. A turn with a tool call gets the tool's
result (never an exception: malformed calls get the parse error as their result) and another turn;
a turn without one is the final answer. The episode also ends on the turn budget, the token budget
or the wall-clock timeout. Tokens the policy sampled carry loss mask 1, their behaviour log-prob and the
temperature it is taken at (model.sampling: the tempered distribution before top-p, which the trainer
scores at that temperature), their policy version and their router choices; template and tool-output
tokens carry mask 0 (and temperature 1).

Self-summarization (``agent.summarize_at_tokens`` > 0) makes an episode a chain of segments. When, after a
tool result, a segment's context plus the next turn's allowance would pass the threshold (and fewer than
``agent.max_summaries`` summaries were written), the tool result is followed by the summary request
instead of the next turn, and the policy writes a summary of at most ``agent.summary_max_tokens`` tokens
(in the compact dialect):

    ...<|end|><|tool|>{result}<|end|><|user|>{summary_prompt}<|end|><|assistant|>{summary}<|end|>

The next segment starts from the task prompt and that summary (the summary's own token ids, mask 0 there:
it is trained once, in the segment that wrote it):

    <|user|>{task prompt}<|end|><|user|>{summary_header}{summary}<|end|><|assistant|>{turn}...

``max_total_tokens`` is each segment's window (the token budget ends the chain when a segment has no room
left and no summary is allowed); ``max_turns`` counts the tool/answer turns of the whole chain (summaries
are not turns); the timeout covers the whole chain. The engine keeps no KV cache between ``generate``
calls (every turn prefills its context), so a new segment costs the prefill of its short prompt: there is
no shared-prefix cache to reuse.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from actors.agent.config import ASSISTANT, END, TOOL, USER, AgentConfig
from actors.agent.dialect import Dialect
from actors.agent.trajectory import EpisodeEnd, Segment, ToolUse, Trajectory
from model.chat import ToolCall, ToolCallError, render_tool_call
from model.generation import Generation
from model.sampling import SamplingParams
from sandbox.tasks import Task

__all__ = [
    "last_code_block",
    "reference_episode_text",
    "resume_prompt_text",
    "run_episode",
    "summary_request_text",
    "task_prompt_text",
    "wants_summary",
]

Generate = Callable[[Sequence[int], SamplingParams], Awaitable[Generation]]
CallTool = Callable[[str, dict[str, Any]], Awaitable[tuple[bool, str]]]
OnTurn = Callable[["Trajectory"], Awaitable[None]]  # after a turn whose tool result is in the transcript

FINAL_ANSWER = "done"
_CODE_BLOCK = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block (```python ... ```) in ``text``; None when it has none."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def task_prompt_text(task: Task) -> str:
    return f"{USER}{task.prompt}{END}{ASSISTANT}"


def summary_request_text(config: AgentConfig) -> str:
    """What follows a tool result's end when the policy is asked for a summary (the assistant continues)."""
    return f"{USER}{config.summary_prompt}{END}{ASSISTANT}"


def resume_prompt_text(task: Task, summary: str, config: AgentConfig) -> str:
    """The prompt of the segment after a summary (as text: the chain itself keeps the summary's token ids)."""
    return f"{USER}{task.prompt}{END}{USER}{config.summary_header}{summary}{END}{ASSISTANT}"


def wants_summary(context_len: int, num_summaries: int, config: AgentConfig) -> bool:
    """After a tool result: would the segment's context plus the next turn's allowance pass the threshold?"""
    return (config.summarizes and num_summaries < config.max_summaries
            and context_len + config.max_new_tokens_per_turn > config.summarize_at_tokens)


def reference_episode_text(task: Task) -> list[tuple[str, bool]]:
    """The episode a perfect agent has on ``task``, as (text, trained) segments: supervised data.

    The tool result text is what ``sandbox.tools.ToolBox`` answers to that call.
    """
    (path, content), = task.reference_solution.items()
    call = render_tool_call(ToolCall("write_file", {"path": path, "content": content}))
    result = f"wrote {len(content.encode())} bytes to {path}"
    return [(task_prompt_text(task), False), (call, True), (f"{END}{TOOL}{result}{END}{ASSISTANT}", False),
            (f"{FINAL_ANSWER}{END}", True)]


async def run_episode(task: Task, generate: Generate, call_tool: CallTool, dialect: Dialect,
                      config: AgentConfig, sampling: SamplingParams, *, start: Trajectory | None = None,
                      on_turn: OnTurn | None = None) -> Trajectory:
    """Runs one episode (a chain of segments); the budget and timeout ends are normal outcomes, not errors.

    Args:
        start: the transcript of an earlier run of this episode after some turns (a rollout checkpoint,
            actors.rollout_checkpoint), continued here as if never interrupted: with the same sampling
            seed and policy versions the rest of the episode is the same token for token. Its turns, and
            its ``duration_s``, count against the budgets. Taken over (mutated), not copied.
        on_turn: awaited after every turn that continues the episode (its tool result appended, or the
            summary that starts the next segment written), with the transcript so far (``duration_s`` up to
            date); it must copy what it keeps.
    """
    started = time.monotonic()
    if start is None:
        traj = Trajectory([Segment.of_prompt(dialect.prompt_ids(task.prompt))], EpisodeEnd.TURN_BUDGET)
    else:
        traj = start
    earlier_s = traj.duration_s

    async def turn_done(t: Trajectory) -> None:
        t.duration_s = earlier_s + time.monotonic() - started
        if on_turn is not None:
            await on_turn(t)

    try:
        async with asyncio.timeout(max(0.0, config.episode_timeout_s - earlier_s)):
            traj.end = await _turns(task, generate, call_tool, dialect, config, sampling, traj, turn_done)
    except TimeoutError:
        traj.end = EpisodeEnd.TIMEOUT
    traj.duration_s = earlier_s + time.monotonic() - started
    return traj


async def _turns(task: Task, generate: Generate, call_tool: CallTool, dialect: Dialect, config: AgentConfig,
                 sampling: SamplingParams, traj: Trajectory, turn_done: OnTurn) -> EpisodeEnd:
    tokenizer, end_id = dialect.tokenizer, dialect.end_id
    while traj.num_turns < config.max_turns:
        seg = traj.segments[-1]
        budget = min(config.max_new_tokens_per_turn, config.max_total_tokens - len(seg.token_ids))
        if budget <= 0:
            return EpisodeEnd.TOKEN_BUDGET
        params = dataclasses.replace(sampling, max_new_tokens=budget, stop_token_ids=(end_id,),
                                     stop_strings=dialect.stop_strings)
        gen = await _generate(generate, seg, params, traj)
        traj.num_turns += 1
        text = tokenizer.decode(gen.token_ids)  # to find the call only: the transcript keeps the sampled ids
        found = dialect.find_tool_call(text)
        if found is None:
            traj.num_final_tokens += len(gen.token_ids)
            if config.answer_file and (code := last_code_block(text)) is not None:
                await call_tool("write_file", {"path": config.answer_file, "content": code})
            return EpisodeEnd.FINAL_ANSWER if gen.token_ids and gen.token_ids[-1] == end_id else (
                EpisodeEnd.TOKEN_BUDGET)
        call_start = dialect.call_start(text)
        num_thinking = len(tokenizer.encode(text[:call_start]))
        traj.num_thinking_tokens += num_thinking
        traj.num_tool_call_tokens += len(gen.token_ids) - num_thinking
        t0 = time.monotonic()
        ok, output = await _use_tool(found, call_tool)
        traj.tools_s += time.monotonic() - t0
        output = output[: config.tool_output_max_chars]
        closed = bool(gen.token_ids) and gen.token_ids[-1] == end_id
        suffix = dialect.tool_result_ids(output, closed=closed)
        num_output = len(tokenizer.encode(output))
        traj.tool_uses.append(ToolUse(getattr(found, "name", ""), ok, isinstance(found, ToolCallError), num_output))
        traj.num_tool_output_tokens += num_output
        last_turn = traj.num_turns >= config.max_turns  # a summary no turn would read is not asked for
        if last_turn or not wants_summary(len(seg.token_ids) + len(suffix), traj.num_summaries, config):
            _append_context(seg, suffix)
            if not last_turn:  # a checkpoint after the last turn would never be resumed
                await turn_done(traj)
            continue
        _append_context(seg, dialect.tool_result_ids(output, closed=closed, then_ask=config.summary_prompt))
        if not await _summarize(task, generate, dialect, config, sampling, traj):
            return EpisodeEnd.TOKEN_BUDGET
        await turn_done(traj)
    return EpisodeEnd.TURN_BUDGET


async def _summarize(task: Task, generate: Generate, dialect: Dialect, config: AgentConfig,
                     sampling: SamplingParams, traj: Trajectory) -> bool:
    """The policy's summary at the end of the last segment, and the next segment started from it; False when
    the window has no room left for one (the chain ends on its token budget)."""
    seg = traj.segments[-1]
    budget = min(config.summary_max_tokens, config.max_total_tokens - len(seg.token_ids))
    if budget <= 0:
        return False
    end_id = dialect.end_id
    params = dataclasses.replace(sampling, max_new_tokens=budget, stop_token_ids=(end_id,), stop_strings=())
    gen = await _generate(generate, seg, params, traj)
    seg.summary_len = len(gen.token_ids)
    traj.num_summary_tokens += len(gen.token_ids)
    summary = gen.token_ids[:-1] if gen.token_ids and gen.token_ids[-1] == end_id else gen.token_ids
    traj.segments.append(Segment.of_prompt(dialect.resume_prompt_ids(task.prompt, config.summary_header, summary)))
    return True


async def _generate(generate: Generate, seg: Segment, params: SamplingParams, traj: Trajectory) -> Generation:
    t0 = time.monotonic()
    gen = await generate(list(seg.token_ids), params)
    traj.generate_s += time.monotonic() - t0
    _append_generation(seg, gen)
    return gen


async def _use_tool(found: ToolCall | ToolCallError, call_tool: CallTool) -> tuple[bool, str]:
    if isinstance(found, ToolCallError):
        return False, f"malformed tool call: {found.reason}"
    return await call_tool(found.name, found.args)


def _append_generation(seg: Segment, gen: Generation) -> None:
    start = len(seg.token_ids)
    n = len(gen.token_ids)
    seg.token_ids += gen.token_ids
    seg.loss_mask += [1] * n
    seg.behaviour_logprobs += gen.logprobs
    seg.logprob_temperatures += [gen.logprob_temperature] * n
    seg.versions += gen.versions
    # the stored form (actors.agent.trajectory): an int16 array, a copy (the engine's tensor is its own)
    rows = gen.topk_ids_TLK.to(device="cpu", dtype=torch.int16).numpy()
    if seg.topk_ids_TLK is None:
        seg.topk_ids_TLK = rows.copy()
        return
    # Keep the routing each sampled token was produced with: rows before this turn's prompt end stay,
    # rows from the last prompt position on come from this generation.
    merged = np.concatenate([seg.topk_ids_TLK[: start - 1], rows[start - 1:]], axis=0)
    seg.topk_ids_TLK = merged
    assert merged.shape[0] == start + n


def _append_context(seg: Segment, ids: list[int]) -> None:
    seg.token_ids += ids
    seg.loss_mask += [0] * len(ids)
    seg.behaviour_logprobs += [0.0] * len(ids)
    seg.logprob_temperatures += [1.0] * len(ids)
    seg.versions += [-1] * len(ids)
    if seg.topk_ids_TLK is not None:
        pad = np.full((len(ids), *seg.topk_ids_TLK.shape[1:]), -1, dtype=np.int16)
        seg.topk_ids_TLK = np.concatenate([seg.topk_ids_TLK, pad], axis=0)
