"""Dense Llama and Qwen3 checkpoints written by transformers load into the policy with logit parity.

Every config is built by transformers at random init and saved with its own `save_pretrained`, so the
config.json keys and tensor names are transformers' own, not ours.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import Architecture, Llama3RopeScaling, ModelConfig
from model.errors import ConfigError
from tests.model.helpers import engine_greedy, hf_dense_model, hf_greedy, random_prompts

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (transformers class, config overrides)
CASES: dict[str, tuple[str, dict[str, object]]] = {
    "llama_gqa_untied": ("llama", {}),
    "llama_mha_tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama_gqa4_bias_mlpbias_llama3": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
                                                 "attention_bias": True, "mlp_bias": True,
                                                 "rope_parameters": LLAMA3_ROPE}),
    "llama_tied_llama3_no_head_dim": ("llama", {"tie_word_embeddings": True, "head_dim": None,
                                                "rope_parameters": {**LLAMA3_ROPE, "factor": 4.0}}),
    "qwen3_gqa_untied": ("qwen3", {}),
    "qwen3_tied_bias": ("qwen3", {"tie_word_embeddings": True, "attention_bias": True,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3_llama3_rope_3layers": ("qwen3", {"num_hidden_layers": 3, "rope_parameters": LLAMA3_ROPE}),
}


def _saved(path: Path, name: str):
    kind, overrides = CASES[name]
    hf = hf_dense_model(kind, seed=len(name), **overrides)
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_dense_checkpoints_load_with_logit_parity(name: str, tmp_path: Path) -> None:
    hf = _saved(tmp_path, name)
    config, ours = load_checkpoint(tmp_path)
    assert config.architecture == Architecture(CASES[name][0])
    assert (config.num_experts, config.num_experts_per_tok) == (0, 0)
    assert config.num_parameters() == sum(p.numel() for p in ours.parameters())
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = torch.tensor(random_prompts(3, 96, 40, 40, seed=len(name)))  # 40 > 16: long wavelengths matter
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours.eval()(ids.reshape(-1), seq_lens=[40, 40, 40])
    got = out.logits.view_as(ref)
    assert float((got - ref).abs().max()) <= 1e-5, float((got - ref).abs().max())
    assert out.topk_ids_TLK.shape == (120, config.num_hidden_layers, 0)


def test_llama3_rope_scaling_is_read_and_changes_the_function(tmp_path: Path) -> None:
    _saved(tmp_path, "llama_gqa4_bias_mlpbias_llama3")
    config, scaled = load_checkpoint(tmp_path)
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    unscaled = type(scaled)(dataclasses.replace(config, rope_scaling=None))
    unscaled.load_state_dict(scaled.state_dict())
    ids = torch.tensor(random_prompts(1, 96, 60, 60, seed=5)[0])
    with torch.no_grad():
        assert float((scaled(ids).logits - unscaled(ids).logits).abs().max()) > 1e-3


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3_tied_bias"])
def test_dense_config_round_trips_through_our_own_checkpoints(name: str, tmp_path: Path) -> None:
    hf = _saved(tmp_path / "hf", name)
    config, ours = load_checkpoint(tmp_path / "hf")
    save_checkpoint(ours, tmp_path / "ours")
    again, reloaded = load_checkpoint(tmp_path / "ours")
    assert again == config
    back = type(hf).from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()  # transformers reads ours
    ids = torch.tensor(random_prompts(2, 96, 12, 12, seed=3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
        assert torch.equal(reloaded(ids.reshape(-1), seq_lens=[12, 12]).logits,
                           ours(ids.reshape(-1), seq_lens=[12, 12]).logits)


def test_greedy_generation_of_a_dense_llama_matches_transformers(tmp_path: Path) -> None:
    """The engine's KV-cache path (prefill, batched one-token decode) without q/k norm, with llama3 RoPE."""
    hf = _saved(tmp_path, "llama_gqa4_bias_mlpbias_llama3")
    _, ours = load_checkpoint(tmp_path)
    prompts = random_prompts(3, 96, 5, 12, seed=2)
    gens = engine_greedy(ours.eval(), prompts, 20)
    assert all(g.topk_ids_TLK.shape[1:] == (2, 0) for g in gens)
    assert [list(g.token_ids) for g in gens] == hf_greedy(hf, prompts, 20)


def _dense_dict(architecture: Architecture, **overrides: object) -> dict[str, object]:
    base = ModelConfig(architecture=architecture, num_experts=0, num_experts_per_tok=0, vocab_size=96,
                       hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_hf_dict()
    return {**base, **overrides}


def _llama_dict(**overrides: object) -> dict[str, object]:
    return _dense_dict(Architecture.LLAMA, **overrides)


def _qwen3_dict(**overrides: object) -> dict[str, object]:
    return _dense_dict(Architecture.QWEN3, **overrides)


@pytest.mark.parametrize(("raw", "named"), [
    (_llama_dict(num_experts=4), "num_experts"),  # a MoE key in a dense config: not read, so refused
    (_llama_dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_llama_dict(model_type="mistral"), "model_type"),
    (_llama_dict(hidden_act="gelu"), "hidden_act"),
    (_llama_dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    (_llama_dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "dynamic"),
    (_llama_dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    (_llama_dict(rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": None}),
     "original_max_position_embeddings"),
    (_llama_dict(rope_parameters={**LLAMA3_ROPE, "attention_factor": 2.0}), "attention_factor"),
    (_llama_dict(rope_parameters={**LLAMA3_ROPE, "high_freq_factor": 1.0}), "high_freq_factor"),
    (_llama_dict(rope_parameters=LLAMA3_ROPE, rope_scaling={**LLAMA3_ROPE, "factor": 2.0}), "RoPE scalings"),
    (_qwen3_dict(mlp_bias=False), "mlp_bias"),  # a llama key in a qwen3 config
    (_qwen3_dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (_qwen3_dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (_qwen3_dict(num_experts_per_tok=2), "num_experts_per_tok"),
])
def test_dense_config_keys_that_may_change_the_model_are_refused_by_name(raw: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_dict(raw)


def test_a_transformers_4x_llama_config_is_read_whole() -> None:
    # The key set of meta-llama/Llama-3.2-1B's config.json (transformers 4.45), with its values.
    raw = json.loads("""{"architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
      "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
      "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
      "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256}""")
    config = ModelConfig.from_hf_dict(raw)
    assert (config.architecture, config.rope_theta, config.tie_word_embeddings) == (Architecture.LLAMA, 5e5, True)
    assert config.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
    assert (config.num_key_value_heads, config.intermediate_size, config.qk_norm) == (8, 8192, False)


def test_dense_configs_refuse_experts_and_moe_configs_refuse_mlp_bias() -> None:
    with pytest.raises(ConfigError, match="pass 0 for both"):
        ModelConfig(architecture=Architecture.QWEN3)
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig(mlp_bias=True)
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig(architecture=Architecture.QWEN3, num_experts=0, num_experts_per_tok=0, mlp_bias=True)
