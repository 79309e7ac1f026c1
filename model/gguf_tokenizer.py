"""tokenizer.json and tokenizer_config.json from a GGUF file's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special token
ids and chat template as metadata. For a byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`) this
builds the `tokenizers` pipeline transformers builds from the same file (`AutoTokenizer.from_pretrained(
dir, gguf_file=...)`): a BPE model over the vocabulary and merges, GPT-2's byte-level pre-tokenizer and
decoder, every CONTROL token as a special added token and every USER_DEFINED one as a plain added token.
tests/model/test_convert.py checks the ids against transformers on varied text.

Only pre-tokenizer types whose split is GPT-2's own are accepted (`tokenizer.ggml.pre`): other BPE
vocabularies (llama-bpe, qwen2, ...) need their own split regex, and sentencepiece vocabularies
(`tokenizer.ggml.model = "llama"`) another model; both are refused by name rather than tokenized wrongly.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from model.errors import CheckpointError

__all__ = ["TOKENIZER_KEYS", "build_tokenizer", "tokenizer_config"]

TOKENIZER_KEYS = frozenset({
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
})
# llama.cpp pre-tokenizer names whose split is GPT-2's regex (which `ByteLevel(use_regex=True)` applies).
_GPT2_SPLIT_PRE = frozenset({"gpt-2", "smollm"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # text -> its byte-alphabet spelling
# Flags that would change the ids, checked against the one value this tokenizer implements.
_FLAGS = {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False,
          "tokenizer.ggml.add_space_prefix": False}
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


@functools.cache
def _byte_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with (`ByteLevel.alphabet()`)."""
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def _byte_spelling(token: str) -> str:
    """A token spelled in the byte alphabet (as llama.cpp usually stores them), or respelled from its UTF-8."""
    if set(token) <= _byte_alphabet():
        return token
    return "".join(piece for piece, _ in _BYTES.pre_tokenize_str(token))


def _check(metadata: dict[str, Any]) -> None:
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"tokenizer.ggml.model={model!r} is not supported; only 'gpt2' (byte-level BPE)")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _GPT2_SPLIT_PRE:
        raise CheckpointError(f"tokenizer.ggml.pre={pre!r} is not supported; only {sorted(_GPT2_SPLIT_PRE)} "
                              "(GPT-2's split regex)")
    for key, supported in _FLAGS.items():
        if metadata.get(key, supported) != supported:
            raise CheckpointError(f"{key}={metadata[key]!r} is not supported; expected {supported!r}")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not metadata.get(key):
            raise CheckpointError(f"GGUF metadata lacks {key}")


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The `tokenizers` pipeline the file's byte-level BPE vocabulary describes.

    Raises:
        CheckpointError: the vocabulary is not byte-level BPE with GPT-2's split, or a flag (BOS/EOS
            added, prefix space) or the tokens or merges are not as this builder supports; names the key.
    """
    _check(metadata)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {_byte_spelling(t): i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicate tokens")
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise CheckpointError(f"tokenizer.ggml.merges holds {' '.join(bad)!r}, not two space-separated tokens")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # tokenizers raises a bare Exception naming the token a merge lacks
        raise CheckpointError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {exc}") from exc
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")  # no BOS/EOS (checked)
    alphabet = _byte_alphabet()
    # A CONTROL token outside the byte alphabet cannot be a real token of this vocabulary (llama.cpp
    # mislabels some); adding it would grow the vocabulary past the model's, so it stays a plain entry.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types, strict=True)
                            if kind == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types, strict=True)
                    if kind == _USER_DEFINED and t in vocab])
    return tok


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by their text, the chat template, and no BOS added."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                           "add_eos_token": False, "clean_up_tokenization_spaces": False}
    for name, key in _SPECIAL.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise CheckpointError(f"tokenizer.ggml.{key}={token_id} is outside the vocabulary ({len(tokens)})")
            out[name] = tokens[token_id]
    if metadata.get("tokenizer.chat_template") is not None:
        out["chat_template"] = metadata["tokenizer.chat_template"]
    return out
