"""Parity with transformers' Qwen3MoeForCausalLM from the same safetensors checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import ModelConfig
from model.errors import ConfigError
from tests.model.helpers import engine_greedy, hf_greedy, random_prompts, seeded_model, small_config

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa2_hd16_e6k2_raw": small_config(norm_topk_prob=False),
    "mha_hd32_e4k1_norm": small_config(
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=1
    ),
    "gqa4_hd8_e8k3_norm_tied": small_config(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=3,
        tie_word_embeddings=True,
    ),
    "gqa3_hd24_e5k2_bias_3layers": small_config(
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=5,
        num_hidden_layers=3,
        attention_bias=True,
        norm_topk_prob=False,
        rope_theta=1e6,
    ),
}


def _load_both(config: ModelConfig, path: Path, seed: int):
    save_checkpoint(seeded_model(config, seed), path)
    _, ours = load_checkpoint(path)
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(path),
        attn_implementation="eager",
        experts_implementation="eager",
        dtype=torch.float32,
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return ours.eval(), hf.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_hf(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]
    ours, hf = _load_both(config, tmp_path, seed=len(name))
    prompts = random_prompts(3, config.vocab_size, 17, 17, seed=1)  # equal lengths: HF without padding
    ids = torch.tensor(prompts)
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids.reshape(-1), seq_lens=[17, 17, 17])
    got = out.logits.view_as(ref)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), float((got - ref).abs().max())
    # single sequence and packed neighbours agree too
    with torch.no_grad():
        single = ours(ids[1]).logits
    assert torch.allclose(single, ref[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generation_matches_hf(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]
    ours, hf = _load_both(config, tmp_path, seed=len(name) + 7)
    prompts = random_prompts(3, config.vocab_size, 5, 12, seed=2)
    assert [list(g.token_ids) for g in engine_greedy(ours, prompts, 24)] == hf_greedy(hf, prompts, 24)


def test_bf16_error_comparable_to_hf(tmp_path: Path) -> None:
    """In bf16 both implementations round differently; ours must be no further from fp32 than HF's."""
    config = CONFIGS["gqa2_hd16_e6k2_raw"]
    save_checkpoint(seeded_model(config, 3), tmp_path)
    ids = torch.tensor(random_prompts(2, config.vocab_size, 20, 20, seed=3))

    def hf_logits(dtype: torch.dtype) -> torch.Tensor:
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
            str(tmp_path), attn_implementation="eager", experts_implementation="eager", dtype=dtype
        )
        with torch.no_grad():
            return hf(ids).logits.float().reshape(-1, config.vocab_size)

    exact = hf_logits(torch.float32)
    hf_err = (hf_logits(torch.bfloat16) - exact).abs().max()
    _, ours = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = ours(ids.reshape(-1), seq_lens=[20, 20]).logits.float()
    our_err = (got - exact).abs().max()
    assert our_err <= 1.5 * hf_err + 1e-2, (float(our_err), float(hf_err))


def _hf_saved(path: Path, num_experts: int, seed: int, **overrides: object):
    """A randomly initialised transformers Qwen3MoeForCausalLM, written by its own save_pretrained."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=num_experts, num_experts_per_tok=min(3, num_experts), norm_topk_prob=num_experts % 4 == 0,
                  max_position_embeddings=128, initializer_range=0.1, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 5e5})
    fields.update(overrides)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).eval()
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("num_experts", [4, 6, 10, 16])
def test_checkpoints_saved_by_transformers_load_with_logit_parity(num_experts: int, tmp_path: Path) -> None:
    # transformers 5.x writes num_local_experts (not num_experts): read, not replaced by the default 8.
    hf = _hf_saved(tmp_path, num_experts, seed=num_experts)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in raw or "num_experts" in raw
    config, ours = load_checkpoint(tmp_path)
    assert (config.num_experts, config.num_experts_per_tok, config.rope_theta) == (num_experts, 3, 5e5)
    ids = torch.tensor(random_prompts(2, 96, 19, 19, seed=num_experts))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.eval()(ids.reshape(-1), seq_lens=[19, 19]).logits.view_as(ref)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), float((got - ref).abs().max())


@pytest.mark.parametrize(("overrides", "named"), [
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
])
def test_transformers_checkpoints_with_unsupported_features_are_refused(
        overrides: dict[str, object], named: str, tmp_path: Path) -> None:
    _hf_saved(tmp_path, 4, seed=1, **overrides)
    with pytest.raises(ConfigError, match=named):
        load_checkpoint(tmp_path)


def test_config_keys_that_may_change_the_model_are_refused_by_name() -> None:
    base = small_config().to_hf_dict()
    for extra in ({"shared_expert_intermediate_size": 64}, {"partial_rotary_factor": 0.5}, {"qk_layernorm": False}):
        with pytest.raises(ConfigError, match=next(iter(extra))):
            ModelConfig.from_hf_dict({**base, **extra})
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({**base, "model_type": "qwen2_moe"})
    with pytest.raises(ConfigError, match="expert counts"):
        ModelConfig.from_hf_dict({**base, "num_local_experts": base["num_experts"] + 1})
    with pytest.raises(ConfigError, match="RoPE bases"):
        ModelConfig.from_hf_dict({**base, "rope_theta": 1e6})  # rope_parameters says 1e4
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                              "partial_rotary_factor": 0.5}})
    inert = {**base, "use_cache": False, "output_router_logits": True, "transformers_version": "5.24.0",
             "dtype": "bfloat16", "sliding_window": 4096}
    assert ModelConfig.from_hf_dict(inert) == small_config()
    renamed = {k: v for k, v in base.items() if k != "num_experts"} | {"num_local_experts": 6}
    assert ModelConfig.from_hf_dict(renamed).num_experts == 6


def test_a_transformers_4x_qwen3_moe_config_is_read_whole() -> None:
    # The key set of Qwen/Qwen3-30B-A3B's config.json (transformers 4.51), with its values.
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
           "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
           "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
           "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
           "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    config = ModelConfig.from_hf_dict(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim, config.rope_theta) == (128, 8, 128, 1e6)
    assert (config.num_hidden_layers, config.norm_topk_prob, config.eos_token_id) == (48, True, 151645)
