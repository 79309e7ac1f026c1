"""The agent loop's settings (``[rollout.agent]``) and the episode template's role markers they must not hold.

Apart from the episode (`actors.agent.episode`, which runs the policy) so that the run's configuration
(`actors.config`), which every actor process reads, imports no torch: the reconciler runs no model, and
a replacement for a frozen one must start within its lease.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import Range, check_ranges, fixed
from runtime.errors import ConfigError

__all__ = ["ASSISTANT", "END", "TOOL", "USER", "AgentConfig"]

USER, ASSISTANT, TOOL, END = "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = fixed(3, within=Range(1, 1000))
    max_new_tokens_per_turn: int = fixed(160, within=Range(1, 1_000_000))
    max_total_tokens: int = fixed(640, within=Range(1, 10_000_000))  # one segment's window
    tool_output_max_chars: int = fixed(400, within=Range(0, 10_000_000))
    episode_timeout_s: float = fixed(300.0, within=Range(0.0, 86_400.0, lo_open=True))
    summarize_at_tokens: int = fixed(0, within=Range(0, 10_000_000))  # 0: no summaries (the window truncates)
    max_summaries: int = fixed(2, within=Range(0, 1000))
    summary_max_tokens: int = fixed(64, within=Range(1, 1_000_000))
    summary_prompt: str = "Summarize your progress."  # the request after the tool result
    summary_header: str = "Notes: "  # before the summary in the next segment's prompt
    # A workspace file (e.g. "solution.py") that a final answer's last fenced code block is written to, as a
    # benchmark harness takes a chat model's completion from its answer; "" leaves answers as text. Tool calls
    # still write files as they always do.
    answer_file: str = ""

    def __post_init__(self) -> None:
        check_ranges(self, "agent")
        parts = self.answer_file.split("/")
        if self.answer_file and (self.answer_file.startswith("/") or any(p in ("", ".", "..") for p in parts)):
            raise ConfigError(f"agent.answer_file={self.answer_file!r} must be a relative path inside the workspace "
                              "(no '..', no empty parts), such as 'solution.py'")
        for name in ("summary_prompt", "summary_header"):
            text = getattr(self, name)
            if not isinstance(text, str) or any(t in text for t in (USER, ASSISTANT, TOOL, END)):
                raise ConfigError(f"agent.{name}={text!r} must be a string without role or end markers")

    @property
    def summarizes(self) -> bool:
        return self.summarize_at_tokens > 0 and self.max_summaries > 0
