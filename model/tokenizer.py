"""Tokenizers: the byte-level tokenizer of the tiny policy, and tokenizer.json for real checkpoints.

Both satisfy `Tokenizer`. `ByteTokenizer` maps bytes 0..255 to ids 0..255 and its special tokens to
256..263; special-token strings inside text encode to their ids, so a rendered chat template (see
`model.chat`, re-exported here) encodes to the markers' single tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from model.chat import (
    ChatMessage,
    ChatTemplate,
    Role,
    ToolCall,
    ToolCallError,
    find_tool_call,
    parse_tool_call,
    render_conversation,
    render_message,
    render_tool_call,
)
from model.errors import CheckpointError

__all__ = [
    "SPECIAL_TOKENS",
    "ByteTokenizer",
    "ChatMessage",
    "ChatTemplate",
    "HFTokenizer",
    "Role",
    "Tokenizer",
    "ToolCall",
    "ToolCallError",
    "find_tool_call",
    "parse_tool_call",
    "render_conversation",
    "render_message",
    "render_tool_call",
]

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|eos|>",
)


class Tokenizer(Protocol):
    """What the engine and the agent loop need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def end_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes plus `SPECIAL_TOKENS`; vocab size 264 (matches `model.config.tiny`)."""

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self.special_ids.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
        self.template = ChatTemplate.compact()

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    @property
    def end_token_id(self) -> int:
        return self.special_ids["<|end|>"]

    @property
    def pad_token_id(self) -> int:
        return self.special_ids["<|pad|>"]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if i not in self._special_by_id:
                raise ValueError(f"token id {i} is outside the byte vocabulary (size {self.vocab_size})")
            out.append(self._special_by_id[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` library (a pretrained checkpoint's; its chat template is
    `model.chat_template.JinjaChatTemplate`)."""

    def __init__(self, path: str | Path, end_token: str = "<|im_end|>") -> None:
        from tokenizers import Tokenizer as _Tok

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.exists():
            raise CheckpointError(f"{file} not found; pass a tokenizer.json or a directory holding one")
        self._tok = _Tok.from_file(str(file))
        end_id = self._tok.token_to_id(end_token)
        if end_id is None:
            raise CheckpointError(f"{file}: end token {end_token!r} is not in the vocabulary")
        self._end_id = end_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def end_token_id(self) -> int:
        return self._end_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
