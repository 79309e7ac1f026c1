"""Reference chains: what a perfect agent does on a long-context task, summaries included (supervised data).

The chain is produced by the real agent loop (actors.agent.episode.run_episode) driven by a scripted policy
(`ReferencePolicy`) and the tools' answers computed from the task's files, so its segments, where its
summaries fall and how each next segment starts are exactly what the loop does with the same
``AgentConfig``: the supervised policy learns the format the rollouts will ask of it. The scripted policy
reads each note in turn, writes the answer once every key is known, then says it is done; asked for a
summary, it writes the keys read so far and whether the answer is written (``notes/1.txt=7 notes/2.txt=3``,
``... notes/3.txt=1 written``): all the next segment needs. Its replies are cut at the turn's token
allowance, as the engine would cut them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from actors.agent.config import END, USER, AgentConfig
from actors.agent.dialect import Dialect
from actors.agent.episode import FINAL_ANSWER, CallTool, run_episode, summary_request_text
from actors.agent.trajectory import Segment, Trajectory
from model.chat import ToolCall, render_tool_call
from model.generation import FinishReason, Generation
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from sandbox.long_context_tasks import note_facts
from sandbox.tasks import Task

__all__ = ["LONG_CONTEXT_AGENT", "ReferencePolicy", "chain_sft_examples", "reference_chain", "summary_of_keys"]

# The agent settings of the long-context family: a 640-token window (today's default), a summary asked
# when the context plus a turn's allowance would pass 560 tokens, turns for three reads, a write and done.
LONG_CONTEXT_AGENT = AgentConfig(max_turns=6, summarize_at_tokens=560, max_summaries=2)


def summary_of_keys(keys: Sequence[tuple[str, int]], written: bool) -> str:
    return " ".join(f"{path}={key}" for path, key in keys) + (" written" if written else "")


def reference_chain(task: Task, config: AgentConfig = LONG_CONTEXT_AGENT) -> Trajectory:
    """The chain of a perfect agent on the long-context ``task`` under ``config`` (blocking); the tools'
    answers are computed from the task's files (a test checks they are the sandbox's, token for token)."""
    return asyncio.run(run_episode(task, ReferencePolicy(task, config).generate, _simulated_tools(task),
                                   Dialect.compact(), config, SamplingParams(temperature=0.0)))


class ReferencePolicy:
    """The scripted perfect agent of a long-context task, deciding from the context alone (stateless: what
    it knows is what the segment shows, the notes of the last summary and the tool results since), so it
    serves any episode of the task, as an engine does (``generate``)."""

    def __init__(self, task: Task, config: AgentConfig = LONG_CONTEXT_AGENT) -> None:
        self.task = task
        self.facts = note_facts(task)
        self.request = summary_request_text(config)
        self.header = config.summary_header
        self.tokenizer = ByteTokenizer()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        ids = self.tokenizer.encode(self.reply(self.tokenizer.decode(prompt_ids)))[: params.max_new_tokens]
        topk = torch.full((len(prompt_ids) + len(ids), 1, 1), -1, dtype=torch.int16)
        return Generation(tuple(prompt_ids), tuple(ids), (0.0,) * len(ids), (0,) * len(ids), topk,
                          FinishReason.STOP_STRING)

    def reply(self, context: str) -> str:
        seen, written = self._known(context)
        if context.endswith(self.request):
            return summary_of_keys(self.facts.keys[:seen], written) + END
        if seen < len(self.facts.keys):
            return render_tool_call(ToolCall("read_file", {"path": self.facts.keys[seen][0]}))
        if not written:
            (path, content), = self.task.reference_solution.items()
            return render_tool_call(ToolCall("write_file", {"path": path, "content": content}))
        return FINAL_ANSWER + END

    def _known(self, context: str) -> tuple[int, bool]:
        """How many notes have been read, and whether the answer is written, by what the context shows."""
        seen, written = 0, False
        notes_at = context.find(f"{USER}{self.header}")
        if notes_at >= 0:
            notes = context[notes_at + len(USER) + len(self.header): context.index(END, notes_at)]
            seen = notes.count("=")
            written = notes.endswith(" written")
        seen += context.count('"name":"read_file"')
        written = written or '"name":"write_file"' in context
        return seen, written


def _simulated_tools(task: Task) -> CallTool:
    async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
        if name == "read_file":
            return True, task.files[args["path"]]
        return True, f"wrote {len(args['content'].encode())} bytes to {args['path']}"

    return call_tool


def chain_sft_examples(chain: Trajectory, tokenizer: ByteTokenizer | None = None) -> list[list[tuple[str, bool]]]:
    """One supervised example per segment: its text in runs of (text, trained), trained where the policy
    wrote (its turns and its summary), as the learner masks a rollout."""
    tokenizer = tokenizer or ByteTokenizer()
    return [_runs(segment, tokenizer) for segment in chain.segments]


def _runs(segment: Segment, tokenizer: ByteTokenizer) -> list[tuple[str, bool]]:
    pairs = zip(segment.token_ids, segment.loss_mask, strict=True)
    return [(tokenizer.decode([t for t, _ in run]), bool(trained))
            for trained, run in itertools.groupby(pairs, key=lambda p: p[1])]
