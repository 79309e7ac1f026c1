"""How an episode speaks to its policy, token in, token out: the prompt, the template tokens between turns,
the tool-call format.

The tokens a policy sampled are never decoded and encoded again: a turn's ids go into the transcript as
sampled (decoding them only finds the tool call), and only the text the chat template puts between two
turns is encoded. That text is the template's own rendering: the conversation is rendered with a
sentinel as the last assistant turn's content and the messages that follow it, and what follows the
sentinel is the continuation (the turn's closing, the tool result's turn, the next assistant prefix).
When the policy closed its turn itself (it sampled the end token), the continuation's leading end token
is dropped. So a BPE merge that re-encoding would make across a turn boundary never happens, and the
trainer scores exactly the ids the engine sampled.

Two dialects: `Dialect.compact` (the byte tokenizer, the compact template, ``<tool>`` calls: the tiny
policy) and `Dialect.from_checkpoint` (a checkpoint's tokenizer.json and chat template, the standard
``<tool_call>`` format, its tools in the template's tool section or, when it has none, described in the
system turn; tool results as the template's ``tool`` turn, or a ``user`` turn when it refuses that role).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.chat import (
    COMPACT_TOOL_CALLS,
    STANDARD_TOOL_CALLS,
    ChatMessage,
    ChatRenderer,
    ChatTemplate,
    Role,
    ToolCall,
    ToolCallError,
    ToolCallSyntax,
    find_tool_call,
)
from model.chat_template import JinjaChatTemplate, TemplateRenderError
from model.errors import CheckpointError
from model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from sandbox.tools import tool_schemas

__all__ = ["Dialect", "load_dialect", "tool_instructions"]

_SENTINEL = "\x00turn\x00"  # no template or tool output holds it (checked on every use)


def tool_instructions(syntax: ToolCallSyntax, tools: Sequence[dict[str, Any]]) -> str:
    """The system turn that teaches a template without a tool section the tools and the call format: one
    line a tool, ``name(arg: type, [optional: type]): description`` (a small model reads every token of it
    in every prompt, so not the whole JSON schema)."""
    lines = []
    for tool in tools:
        spec = tool["function"]
        props, required = spec["parameters"]["properties"], set(spec["parameters"]["required"])
        kinds = {a: "|".join(p["type"]) if isinstance(p["type"], list) else p["type"] for a, p in props.items()}
        args = ", ".join(f"{a}: {k}" if a in required else f"[{a}: {k}]" for a, k in kinds.items())
        lines.append(f"- {spec['name']}({args}): {spec['description']}")
    example = json.dumps({"name": "write_file", syntax.args_key: {"path": "solution.py", "content": "..."}})
    return ("You are a coding agent working in a sandboxed workspace. You may call one tool per turn; its "
            f"result comes back in the next turn. To call a tool, write {syntax.open}JSON{syntax.close} with "
            f"the tool's name and {syntax.args_key}, for example:\n{syntax.open}{example}{syntax.close}\n"
            "When you are done, answer without a tool call.\nThe tools:\n" + "\n".join(lines))


@dataclass(frozen=True)
class Dialect:
    """A tokenizer, the chat template it is rendered with, and the tool-call format.

    Attributes:
        system: the system turn's text ('' for none).
        tools: the tool schemas handed to a template with a tool section.
        tool_role: the role tool results are sent back in.
    """

    tokenizer: Tokenizer
    renderer: ChatRenderer
    tool_calls: ToolCallSyntax
    system: str = ""
    tools: tuple[dict[str, Any], ...] = ()
    tool_role: Role = Role.TOOL
    _head: tuple[ChatMessage, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_head", (ChatMessage(Role.SYSTEM, self.system),) if self.system else ())
        self._continuation([], closed=True)  # a template that cannot close a turn fails here, not mid-run

    @classmethod
    def compact(cls) -> Dialect:
        """The tiny policy's: byte tokens, ``<|user|>...<|end|><|assistant|>``, ``<tool>`` calls."""
        return cls(ByteTokenizer(), ChatTemplate.compact(), COMPACT_TOOL_CALLS)

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> Dialect:
        """A pretrained checkpoint's: its tokenizer.json, its chat template, its end-of-turn token (the
        ``eos_token`` of tokenizer_config.json), ``<tool_call>`` calls.

        Raises:
            CheckpointError: a file missing or unreadable, a template that cannot be rendered into turns.
        """
        template = JinjaChatTemplate.from_checkpoint(directory)
        end = template.special_tokens.get("eos_token")
        if not end:
            raise CheckpointError(f"{directory}/tokenizer_config.json names no eos_token: the policy's turns "
                                  "could not end")
        tokenizer = HFTokenizer(directory, end_token=end)
        tools = tuple(tool_schemas())
        with_section = template.has_tool_section
        system = "" if with_section else tool_instructions(STANDARD_TOOL_CALLS, tools)
        return cls(tokenizer, template, STANDARD_TOOL_CALLS, system, tools if with_section else (),
                   _tool_role(template))

    @property
    def end_id(self) -> int:
        return self.tokenizer.end_token_id

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Where a turn's generation stops besides the end token: right after a tool call."""
        return (self.tool_calls.close,)

    def find_tool_call(self, text: str) -> ToolCall | ToolCallError | None:
        return find_tool_call(text, self.tool_calls)

    def call_start(self, text: str) -> int:
        """Where the tool call starts in a turn's text (-1: none)."""
        return text.find(self.tool_calls.open)

    def _render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        return self.renderer.render([*self._head, *messages], add_generation_prompt, self.tools)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The first segment's context: the task as the user's turn, then the assistant prefix."""
        return self.tokenizer.encode(self._render([ChatMessage(Role.USER, prompt)], True))

    def tool_result_ids(self, output: str, *, closed: bool, then_ask: str = "") -> list[int]:
        """What follows a turn with a tool call: the turn's closing (unless the policy ``closed`` it), the
        tool result's turn, ``then_ask`` as a user turn when given (the summary request), the assistant prefix."""
        then = [ChatMessage(self.tool_role, output)]
        if then_ask:
            then.append(ChatMessage(Role.USER, then_ask))
        return self._continuation(then, closed=closed)

    def resume_prompt_ids(self, prompt: str, header: str, summary_ids: Sequence[int]) -> list[int]:
        """The context of a segment after a summary: the task, then ``header`` and the summary's own ids as a
        user turn, then the assistant prefix."""
        text = self._render([ChatMessage(Role.USER, prompt), ChatMessage(Role.USER, header + _SENTINEL)], True)
        before, after = _split_once(text, "the summary")
        return self.tokenizer.encode(before) + list(summary_ids) + self.tokenizer.encode(after)

    def _continuation(self, then: list[ChatMessage], *, closed: bool) -> list[int]:
        probe = [ChatMessage(Role.USER, "task"), ChatMessage(Role.ASSISTANT, _SENTINEL), *then]
        _, after = _split_once(self._render(probe, True), "the assistant's turn")
        ids = self.tokenizer.encode(after)
        if not closed:
            return ids
        if not ids or ids[0] != self.end_id:
            raise CheckpointError(f"the chat template does not close an assistant turn with the end token "
                                  f"(id {self.end_id}): after a turn it renders {after[:60]!r}")
        return ids[1:]  # the policy sampled the end token itself


def _split_once(text: str, what: str) -> tuple[str, str]:
    before, sep, after = text.partition(_SENTINEL)
    if not sep or _SENTINEL in after:
        raise CheckpointError(f"the chat template does not render {what} verbatim (once): it cannot be "
                              "continued token by token")
    return before, after


def _tool_role(template: JinjaChatTemplate) -> Role:
    """``tool`` when the template renders a tool turn with its content, else ``user``."""
    probe = [ChatMessage(Role.USER, "task"), ChatMessage(Role.ASSISTANT, "call"), ChatMessage(Role.TOOL, _SENTINEL)]
    try:
        text = template.render(probe, True)
    except TemplateRenderError:
        return Role.USER
    return Role.TOOL if _SENTINEL in text else Role.USER


# what `load_dialect` reads of a checkpoint: a process that needs only the dialect fetches only these
DIALECT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def load_dialect(directory: str | Path) -> Dialect:
    """The dialect of the policy checkpoint in ``directory``: its own when it carries a tokenizer.json (a
    pretrained checkpoint), else the tiny policy's compact one."""
    if (Path(directory) / "tokenizer.json").exists():
        return Dialect.from_checkpoint(directory)
    return Dialect.compact()
