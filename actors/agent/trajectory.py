"""What one episode leaves behind, as data: its chain of segments, how it ended, its tools and counters.

Apart from the agent loop (`actors.agent.episode`, which runs the policy and so needs torch and the model)
because every stage that only reads an episode imports these types: the records (`actors.records`), the
reward and grouping actors, rollout checkpoints, the dashboard. Those processes load no torch
(tests/test_import_graph.py), so a segment's router choices are a numpy array here, not a tensor: where
a tensor is needed (the learner's router replay) ``torch.from_numpy`` views the same memory.

Shapes: T positions of a segment, L layers, K experts chosen per token and layer (``topk_ids_TLK``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["EpisodeEnd", "Segment", "ToolUse", "Trajectory"]


class EpisodeEnd(enum.StrEnum):
    FINAL_ANSWER = "final_answer"
    TURN_BUDGET = "turn_budget"
    TOKEN_BUDGET = "token_budget"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class ToolUse:
    name: str
    ok: bool
    malformed: bool
    num_output_tokens: int


@dataclass
class Segment:
    """One context window of an episode: what the trainer packs as one sequence.

    ``topk_ids_TLK``: the router choices each position was computed with, (T, L, K) int16 (-1 rows: none
    recorded, e.g. tool output appended after a generation); None until the policy generated in it.
    ``summary_len``: the tokens of the summary the policy wrote at this segment's end (0 for the chain's last
    segment, which has none)."""

    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    logprob_temperatures: list[float]  # T of softmax(logits / T) each behaviour log-prob is taken under
    versions: list[int]  # -1 where the policy did not sample the token
    topk_ids_TLK: np.ndarray | None
    prompt_len: int
    summary_len: int = 0

    @classmethod
    def of_prompt(cls, prompt: Sequence[int]) -> Segment:
        n = len(prompt)
        return cls(list(prompt), [0] * n, [0.0] * n, [1.0] * n, [-1] * n, None, n)


@dataclass
class Trajectory:
    """Everything the reward, grouping and trainer stages need from one episode (stored typed, in the
    records of actors.records: the router choices as int16 bytes): a chain of segments, one without
    summaries, and the chain's counters (over every segment: the reward's length penalty counts the chain)."""

    segments: list[Segment]
    end: EpisodeEnd
    tool_uses: list[ToolUse] = field(default_factory=list)
    num_turns: int = 0
    num_tool_call_tokens: int = 0
    num_tool_output_tokens: int = 0
    num_final_tokens: int = 0
    num_thinking_tokens: int = 0
    num_summary_tokens: int = 0
    duration_s: float = 0.0
    generate_s: float = 0.0
    tools_s: float = 0.0

    @property
    def num_malformed_calls(self) -> int:
        return sum(u.malformed for u in self.tool_uses)

    @property
    def num_summaries(self) -> int:
        return len(self.segments) - 1  # a summary always starts the next segment

    @property
    def num_tokens(self) -> int:
        """Tokens over every segment (a summary counts once where written, once in the next prompt)."""
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def policy_token_ids(self) -> list[int]:
        """Every token the policy sampled, in order, over the chain."""
        return [t for s in self.segments for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]

    @property
    def min_version(self) -> int:
        sampled = [v for s in self.segments for v in s.versions if v >= 0]
        return min(sampled) if sampled else 0

    @property
    def max_version(self) -> int:
        return max((v for s in self.segments for v in s.versions), default=0)
