"""A checkpoint's own chat template (jinja, in its tokenizer_config.json), rendered as transformers renders it.

The same jinja environment `transformers.apply_chat_template` uses: sandboxed and immutable (a template
from a checkpoint is untrusted code), ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that does not escape HTML, and the ``raise_exception`` and
``strftime_now`` globals; the checkpoint's special tokens (``bos_token``, ``eos_token``, ...) are
variables. The ``{% generation %}`` tag (transformers' assistant-mask tracking) is not supported: a
template using it is refused when loaded. The policy never re-encodes what it sampled, so only the text
a template puts between turns is ever encoded (`actors.agent.dialect`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.chat import ChatMessage
from model.errors import CheckpointError

__all__ = ["JinjaChatTemplate", "TemplateRenderError"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateRenderError(ValueError):
    """The template refused a conversation (its ``raise_exception``) or failed while rendering it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaChatTemplate:
    """A chat template and the special tokens it may refer to (satisfies `model.chat.ChatRenderer`)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, where: str = "chat_template") -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
            self._variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise CheckpointError(f"{where} is not a chat template this renderer reads (line {e.lineno}: "
                                  f"{e.message}); templates using transformers' {{% generation %}} tag are not "
                                  "supported") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> JinjaChatTemplate:
        """The template of a checkpoint in the HF layout: ``chat_template.jinja`` if present, else the
        ``chat_template`` of tokenizer_config.json (a string; a list of named templates uses ``default``).

        Raises:
            CheckpointError: no template, or one that does not parse.
        """
        root = Path(directory)
        config_file = root / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.exists() else {}
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{config_file} is not readable JSON ({e})") from None
        special = {k: v for k in _SPECIAL_TOKEN_KEYS if isinstance(v := config.get(k), str)}
        jinja_file = root / "chat_template.jinja"
        if jinja_file.exists():
            return cls(jinja_file.read_text(), special, str(jinja_file))
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            raise CheckpointError(f"{root} has no chat template (no chat_template.jinja, no chat_template string in "
                                  "tokenizer_config.json): add the checkpoint's template there")
        return cls(source, special, f"{config_file}:chat_template")

    @property
    def has_tool_section(self) -> bool:
        """Whether the template reads the ``tools`` variable (else tools are described in the system turn)."""
        return "tools" in self._variables

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
               tools: Sequence[dict[str, Any]] = ()) -> str:
        """The conversation as the template renders it.

        Raises:
            TemplateRenderError: the template raised (a role it does not know, an order it refuses).
        """
        variables: dict[str, Any] = {
            **self.special_tokens,
            "messages": [{"role": m.role.value, "content": m.content} for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            variables["tools"] = list(tools)
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateRenderError(f"the chat template refused the conversation: {e}") from None
