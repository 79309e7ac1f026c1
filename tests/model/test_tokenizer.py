"""Byte tokenizer, tokenizer.json loading, chat template and tool-call parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model.config import tiny
from model.errors import CheckpointError
from model.tokenizer import (
    ByteTokenizer,
    ChatMessage,
    HFTokenizer,
    Role,
    ToolCall,
    ToolCallError,
    find_tool_call,
    parse_tool_call,
    render_conversation,
    render_tool_call,
)


@given(st.text())
def test_byte_roundtrip(text: str) -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_and_vocab_matches_tiny() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == tiny().vocab_size == 264
    ids = tok.encode("<|user|>hé<|end|>")
    assert ids == [tok.special_ids["<|user|>"], 104, 0xC3, 0xA9, tok.end_token_id]
    with pytest.raises(ValueError, match="outside"):
        tok.decode([999])


def test_chat_template_renders_compactly() -> None:
    call = ToolCall("write_file", {"path": "a.py", "content": "x = 1\n"})
    text = render_conversation(
        [
            ChatMessage(Role.SYSTEM, "sys"),
            ChatMessage(Role.USER, "fix it"),
            ChatMessage(Role.ASSISTANT, "ok" + render_tool_call(call)),
            ChatMessage(Role.TOOL, "done"),
        ]
    )
    assert text == (
        '<|system|>sys<|end|><|user|>fix it<|end|><|assistant|>ok<tool>{"name":"write_file",'
        '"args":{"path":"a.py","content":"x = 1\\n"}}</tool><|end|><|tool|>done<|end|><|assistant|>'
    )
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert parse_tool_call(text) == call


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("no call here", "no tool call"),
        ("<tool>{bad json</tool>", "not valid JSON"),
        ('<tool>{"name": "x"', "not closed"),
        ("<tool>[1, 2]</tool>", "JSON object"),
        ('<tool>{"args": {}}</tool>', '"name"'),
        ('<tool>{"name": "x", "args": [1]}</tool>', '"args"'),
        ('<tool>{"name": "x", "args": {}, "extra": 1}</tool>', "unknown keys"),
    ],
)
def test_malformed_tool_calls_are_error_values(text: str, reason: str) -> None:
    result = parse_tool_call(text)
    assert isinstance(result, ToolCallError) and reason in result.reason


@given(st.text())
def test_parse_never_raises(text: str) -> None:
    assert isinstance(parse_tool_call(text), ToolCall | ToolCallError)
    assert find_tool_call(text) is None or isinstance(find_tool_call(text), ToolCall | ToolCallError)


def test_hf_tokenizer_json_loading(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    inner.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    inner.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.vocab_size == 29 and tok.end_token_id == inner.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == inner.token_to_id("<|im_start|>") and ids[-1] == tok.end_token_id
    assert "hi" in tok.decode(ids).replace(" ", "")
    with pytest.raises(CheckpointError, match="not found"):
        HFTokenizer(tmp_path / "missing")
