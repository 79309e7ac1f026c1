"""The chat and tool-call template the agent loop speaks.

Compact on purpose: the tiny byte-level policy must learn it. A conversation renders as

    <|system|>You are ...<|end|><|user|>Fix the bug<|end|>
    <|assistant|>Looking.<tool>{"name":"read_file","args":{"path":"a.py"}}</tool><|end|>
    <|tool|>...file...<|end|><|assistant|>

(line breaks added here for reading; the template has none).

A tool call is one `<tool>JSON</tool>` block inside an assistant turn, JSON `{"name": str, "args": object}`.
Generation stops on the `</tool>` stop string or the end token. `parse_tool_call` never raises: a
malformed call is a `ToolCallError` value whose `reason` can be shown to the model.
Real checkpoints use `ChatTemplate.chatml()` (Qwen's `<|im_start|>role\\n ... <|im_end|>\\n`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable
from typing import Any

__all__ = [
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "ChatMessage",
    "ChatTemplate",
    "Role",
    "ToolCall",
    "ToolCallError",
    "find_tool_call",
    "parse_tool_call",
    "render_conversation",
    "render_message",
    "render_tool_call",
]

TOOL_OPEN = "<tool>"
TOOL_CLOSE = "</tool>"


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


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Role markers: a turn renders as `role_prefix[role] + content + end`."""

    role_prefix: dict[Role, str]
    end: str

    @classmethod
    def compact(cls) -> ChatTemplate:
        """The byte tokenizer's template; every marker is one special token."""
        return cls({r: f"<|{r.value}|>" for r in Role}, "<|end|>")

    @classmethod
    def chatml(cls) -> ChatTemplate:
        """Qwen / ChatML markers for real checkpoints."""
        return cls({r: f"<|im_start|>{r.value}\n" for r in Role}, "<|im_end|>\n")


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


def render_tool_call(call: ToolCall) -> str:
    """`<tool>{"name":...,"args":{...}}</tool>` with compact JSON separators."""
    body = json.dumps({"name": call.name, "args": call.args}, separators=(",", ":"), ensure_ascii=False)
    return f"{TOOL_OPEN}{body}{TOOL_CLOSE}"


def _decode_call(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"tool call is not valid JSON: {exc.msg} at position {exc.pos}", body)
    if not isinstance(obj, dict):
        return ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}", body)
    name, args = obj.get("name"), obj.get("args", {})
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call needs a non-empty string "name"', body)
    if not isinstance(args, dict):
        return ToolCallError(f'tool call "args" must be a JSON object, got {type(args).__name__}', body)
    extra = sorted(set(obj) - {"name", "args"})
    if extra:
        return ToolCallError(f"tool call has unknown keys {extra}; only name and args are allowed", body)
    return ToolCall(name, args)


def find_tool_call(text: str) -> ToolCall | ToolCallError | None:
    """The first tool call in an assistant turn; None when the turn has no `<tool>` block at all."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return None
    body_start = start + len(TOOL_OPEN)
    end = text.find(TOOL_CLOSE, body_start)
    if end < 0:
        return ToolCallError(f"tool call is not closed with {TOOL_CLOSE}", text[start:])
    return _decode_call(text[body_start:end].strip())


def parse_tool_call(text: str) -> ToolCall | ToolCallError:
    """Like `find_tool_call`, but a turn without a call is an error value too."""
    found = find_tool_call(text)
    if found is None:
        return ToolCallError(f"no tool call: expected {TOOL_OPEN}{{...}}{TOOL_CLOSE}", text[:200])
    return found
