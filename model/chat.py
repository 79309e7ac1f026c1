"""The chat and tool-call formats the agent loop speaks.

The tiny byte-level policy speaks a compact one it must learn. A conversation renders as

    <|system|>You are ...<|end|><|user|>Fix the bug<|end|>
    <|assistant|>Looking.<tool>{"name":"read_file","args":{"path":"a.py"}}</tool><|end|>
    <|tool|>...file...<|end|><|assistant|>

(line breaks added here for reading; the template has none). A pretrained checkpoint speaks its own chat
template (`model.chat_template.JinjaChatTemplate`, rendered as transformers renders it) and the de-facto
standard tool call ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Both renderers satisfy
`ChatRenderer`; `ToolCallSyntax` names the two tool-call formats.

Generation stops on the format's closing tag or the end token. `parse_tool_call` never raises: a malformed
call is a `ToolCallError` value whose `reason` can be shown to the model.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

__all__ = [
    "COMPACT_TOOL_CALLS",
    "STANDARD_TOOL_CALLS",
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "ChatMessage",
    "ChatRenderer",
    "ChatTemplate",
    "Role",
    "ToolCall",
    "ToolCallError",
    "ToolCallSyntax",
    "find_tool_call",
    "parse_tool_call",
    "render_conversation",
    "render_message",
    "render_tool_call",
]

TOOL_OPEN = "<tool>"
TOOL_CLOSE = "</tool>"


@dataclasses.dataclass(frozen=True)
class ToolCallSyntax:
    """A tool-call format: ``open + {"name": str, args_key: object} + close``."""

    open: str
    close: str
    args_key: str


COMPACT_TOOL_CALLS = ToolCallSyntax(TOOL_OPEN, TOOL_CLOSE, "args")  # the tiny policy's
STANDARD_TOOL_CALLS = ToolCallSyntax("<tool_call>", "</tool_call>", "arguments")  # Hermes / Qwen / most checkpoints


class Role(enum.StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: tool name and JSON-object arguments."""

    name: str
    args: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A malformed call; `reason` says what was wrong, `text` is the offending block."""

    reason: str
    text: str = ""


class ChatRenderer(Protocol):
    """Renders a conversation to the text a policy reads; with ``add_generation_prompt`` it ends where the
    assistant's next turn begins. ``tools`` (JSON schemas) reach a template that has a tool section."""

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
               tools: Sequence[dict[str, Any]] = ()) -> str: ...

    @property
    def has_tool_section(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Role markers: a turn renders as `role_prefix[role] + content + end`."""

    role_prefix: dict[Role, str]
    end: str

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
               tools: Sequence[dict[str, Any]] = ()) -> str:
        del tools  # no tool section: the tiny policy learns its tools
        return render_conversation(messages, add_generation_prompt, self)

    @property
    def has_tool_section(self) -> bool:
        return False

    @classmethod
    def compact(cls) -> ChatTemplate:
        """The byte tokenizer's template; every marker is one special token."""
        return cls({r: f"<|{r.value}|>" for r in Role}, "<|end|>")


def render_message(message: ChatMessage, template: ChatTemplate | None = None) -> str:
    t = template or ChatTemplate.compact()
    return f"{t.role_prefix[message.role]}{message.content}{t.end}"


def render_conversation(
    messages: Iterable[ChatMessage], add_generation_prompt: bool = True, template: ChatTemplate | None = None
) -> str:
    """All turns, then (by default) the assistant prefix the model continues from."""
    t = template or ChatTemplate.compact()
    text = "".join(render_message(m, t) for m in messages)
    return text + t.role_prefix[Role.ASSISTANT] if add_generation_prompt else text


def render_tool_call(call: ToolCall, syntax: ToolCallSyntax = COMPACT_TOOL_CALLS) -> str:
    """``open{"name":...,args_key:{...}}close`` with compact JSON separators."""
    body = json.dumps({"name": call.name, syntax.args_key: call.args}, separators=(",", ":"), ensure_ascii=False)
    return f"{syntax.open}{body}{syntax.close}"


def _decode_call(body: str, syntax: ToolCallSyntax) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"tool call is not valid JSON: {exc.msg} at position {exc.pos}", body)
    if not isinstance(obj, dict):
        return ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}", body)
    key = syntax.args_key
    name, args = obj.get("name"), obj.get(key, {})
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call needs a non-empty string "name"', body)
    if not isinstance(args, dict):
        return ToolCallError(f'tool call "{key}" must be a JSON object, got {type(args).__name__}', body)
    extra = sorted(set(obj) - {"name", key})
    if extra:
        return ToolCallError(f"tool call has unknown keys {extra}; only name and {key} are allowed", body)
    return ToolCall(name, args)


def find_tool_call(text: str, syntax: ToolCallSyntax = COMPACT_TOOL_CALLS) -> ToolCall | ToolCallError | None:
    """The first tool call in an assistant turn; None when the turn has no opening tag at all."""
    start = text.find(syntax.open)
    if start < 0:
        return None
    body_start = start + len(syntax.open)
    end = text.find(syntax.close, body_start)
    if end < 0:
        return ToolCallError(f"tool call is not closed with {syntax.close}", text[start:])
    return _decode_call(text[body_start:end].strip(), syntax)


def parse_tool_call(text: str, syntax: ToolCallSyntax = COMPACT_TOOL_CALLS) -> ToolCall | ToolCallError:
    """Like `find_tool_call`, but a turn without a call is an error value too."""
    found = find_tool_call(text, syntax)
    if found is None:
        return ToolCallError(f"no tool call: expected {syntax.open}{{...}}{syntax.close}", text[:200])
    return found
