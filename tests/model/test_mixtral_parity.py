"""Mixtral checkpoints written by transformers load into the policy with logit parity, and ours load in transformers.

Every config is built by transformers at random init and saved with its own `save_pretrained`, so the
config.json keys and the tensor names on disk (`block_sparse_moe.experts.{e}.w1.weight`, ...) are
transformers' own, not ours.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import checked_state, load_checkpoint, load_state_into, save_checkpoint, to_hf_state_dict
from model.config import Architecture, Llama3RopeScaling, ModelConfig
from model.errors import CheckpointError, ConfigError
from model.transformer import MoETransformer
from tests.model.helpers import engine_greedy, hf_greedy, random_prompts, seeded_model, small_config

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES: dict[str, dict[str, object]] = {
    "gqa_e4k2_untied": {},
    "mha_e3k1_tied": {"num_key_value_heads": 4, "num_local_experts": 3, "num_experts_per_tok": 1,
                      "tie_word_embeddings": True},
    "gqa4_e6k3_llama3_3layers": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
                                 "num_local_experts": 6, "num_experts_per_tok": 3, "num_hidden_layers": 3,
                                 "rope_parameters": LLAMA3_ROPE},
    "no_head_dim_e5k5_theta1e4": {"head_dim": None, "num_local_experts": 5, "num_experts_per_tok": 5,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
}


def hf_mixtral(seed: int, **overrides: object):
    """A transformers MixtralForCausalLM at random init, small sizes."""
    torch.manual_seed(seed)
    fields: dict[str, object] = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.1)
    fields.update(overrides)
    if fields.get("head_dim") is None:
        fields.pop("head_dim")
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**fields)).eval()


def _saved(path: Path, name: str):
    hf = hf_mixtral(seed=len(name), **CASES[name])
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_mixtral_checkpoints_load_with_logit_parity(name: str, tmp_path: Path) -> None:
    hf = _saved(tmp_path, name)
    assert any(".block_sparse_moe.experts.0.w1." in k for k in load_file(str(tmp_path / "model.safetensors")))
    config, ours = load_checkpoint(tmp_path)
    assert config.architecture is Architecture.MIXTRAL and not config.qk_norm
    assert (config.num_experts, config.num_experts_per_tok) == (hf.config.num_local_experts,
                                                                hf.config.num_experts_per_tok)
    assert config.num_parameters() == sum(p.numel() for p in ours.parameters())
    assert config.rope_scaling == (Llama3RopeScaling(8.0, 1.0, 4.0, 64) if "llama3" in name else None)
    ids = torch.tensor(random_prompts(3, 96, 40, 40, seed=len(name)))  # 40 > 16: long wavelengths matter
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours.eval()(ids.reshape(-1), seq_lens=[40, 40, 40])
    got = out.logits.view_as(ref)
    assert float((got - ref).abs().max()) <= 1e-5, float((got - ref).abs().max())
    assert out.topk_ids_TLK.shape == (120, config.num_hidden_layers, config.num_experts_per_tok)


def test_our_mixtral_checkpoints_load_in_transformers_and_round_trip(tmp_path: Path) -> None:
    hf = _saved(tmp_path / "hf", "gqa_e4k2_untied")
    config, ours = load_checkpoint(tmp_path / "hf")
    save_checkpoint(ours, tmp_path / "ours")
    assert set(load_file(str(tmp_path / "ours" / "model.safetensors"))) == set(
        load_file(str(tmp_path / "hf" / "model.safetensors")))  # the same names as transformers writes
    again, reloaded = load_checkpoint(tmp_path / "ours")
    assert again == config
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                                   output_loading_info=True)
    assert type(back) is transformers.MixtralForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.tensor(random_prompts(2, 96, 12, 12, seed=3))
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, hf(ids).logits)
        assert torch.equal(reloaded(ids.reshape(-1), seq_lens=[12, 12]).logits,
                           ours(ids.reshape(-1), seq_lens=[12, 12]).logits)


def test_greedy_generation_of_a_mixtral_matches_transformers(tmp_path: Path) -> None:
    """The engine's KV-cache path on a MoE without q/k norm (every token's experts recorded)."""
    hf = _saved(tmp_path, "gqa4_e6k3_llama3_3layers")
    _, ours = load_checkpoint(tmp_path)
    prompts = random_prompts(3, 96, 5, 12, seed=2)
    gens = engine_greedy(ours.eval(), prompts, 20)
    assert all(g.topk_ids_TLK.shape[1:] == (3, 3) for g in gens)
    assert [list(g.token_ids) for g in gens] == hf_greedy(hf, prompts, 20)


def _mixtral_config(**overrides: object) -> ModelConfig:
    return small_config(**{"architecture": "mixtral", "intermediate_size": 32, **overrides})


def test_transformers_in_memory_names_and_qwen3_moe_expert_names_load_into_a_mixtral() -> None:
    """The fused in-memory layout (gate_up_proj) and the per-expert names the trainer's shards use."""
    hf = hf_mixtral(1, intermediate_size=32, num_local_experts=6)
    ours = MoETransformer(ModelConfig.from_hf_dict(hf.config.to_diff_dict()))
    load_state_into(ours, hf.state_dict())
    ids = torch.tensor(random_prompts(1, 96, 10, 10, seed=1))
    with torch.no_grad():
        assert float((ours.eval()(ids[0]).logits - hf(ids).logits[0]).abs().max()) <= 1e-5
    projections = {"w_gate_EFD": "gate_proj", "w_up_EFD": "up_proj", "w_down_EDF": "down_proj"}
    qwen_named = {}
    for name, tensor in ours.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        for e in range(tensor.shape[0] if leaf in projections else 0):
            qwen_named[f"{prefix}.experts.{e}.{projections[leaf]}.weight"] = tensor[e]
        if leaf not in projections:
            qwen_named[name] = tensor
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in qwen_named
    again = MoETransformer(ours.config)
    load_state_into(again, qwen_named)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


def test_mixtral_names_in_a_qwen3_moe_checkpoint_and_twice_given_experts_are_refused() -> None:
    mixtral = seeded_model(_mixtral_config())
    named = to_hf_state_dict(mixtral)
    qwen3_moe = MoETransformer(small_config())
    with pytest.raises(CheckpointError, match="block_sparse_moe"):
        checked_state(qwen3_moe, named)
    twice = named | {"model.layers.0.mlp.experts.0.gate_proj.weight": named[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"]}
    with pytest.raises(CheckpointError, match="given twice"):
        checked_state(mixtral, twice)


def test_a_transformers_4x_mixtral_config_is_read_whole() -> None:
    # The key set of mistralai/Mixtral-8x7B-v0.1's config.json (transformers 4.36), with its values.
    raw = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
           "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
    config = ModelConfig.from_hf_dict(raw)
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (Architecture.MIXTRAL, 8, 2)
    assert (config.moe_intermediate_size, config.intermediate_size, config.head_dim) == (14336, 14336, 128)
    assert (config.rope_theta, config.norm_topk_prob, config.attention_bias) == (1e6, True, False)
    no_theta = {k: v for k, v in raw.items() if k != "rope_theta"}
    assert ModelConfig.from_hf_dict(no_theta).rope_theta == 1e6  # MixtralConfig.default_theta, not 1e4


def _mixtral_dict(**overrides: object) -> dict[str, object]:
    return {**_mixtral_config().to_hf_dict(), **overrides}


@pytest.mark.parametrize(("raw", "named"), [
    (_mixtral_dict(sliding_window=16), "sliding_window"),  # Mixtral's window is on whenever it is set
    (_mixtral_dict(router_jitter_noise=0.1), "router_jitter_noise"),
    (_mixtral_dict(attention_bias=True), "attention_bias"),  # not a Mixtral key: not read, so refused
    (_mixtral_dict(norm_topk_prob=False), "norm_topk_prob"),
    (_mixtral_dict(moe_intermediate_size=16), "moe_intermediate_size"),
    (_mixtral_dict(hidden_act="gelu"), "hidden_act"),
    (_mixtral_dict(intermediate_size=None), "intermediate_size"),
    (_mixtral_dict(num_experts=5), "expert counts"),  # num_local_experts says 6
    (_mixtral_dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
])
def test_mixtral_config_keys_that_may_change_the_model_are_refused_by_name(raw: dict[str, object],
                                                                          named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize(("overrides", "named"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"intermediate_size": 64}, "one MLP width"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_mixtral_configs_refuse_what_mixtral_cannot_compute(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _mixtral_config(**overrides)
