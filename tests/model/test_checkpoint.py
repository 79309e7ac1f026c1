"""Checkpoints: HF key layout, round trips, shards, tied embeddings, config validation, experts fn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import from_hf_state_dict, load_checkpoint, save_checkpoint, to_hf_state_dict
from model.config import ModelConfig, medium_100m, tiny
from model.errors import CheckpointError, ConfigError
from model.experts import reference_experts_forward
from model.transformer import MoETransformer
from tests.model.helpers import seeded_model, small_config


def test_hf_key_layout_and_roundtrip(tmp_path: Path) -> None:
    config = small_config(num_experts=3)
    model = seeded_model(config, seed=1)
    save_checkpoint(model, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys and "lm_head.weight" in keys
    assert not any("w_gate_EFD" in k for k in keys)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_moe" and raw["moe_intermediate_size"] == 32
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == config
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tied_embeddings_and_sharded_index(tmp_path: Path) -> None:
    config = small_config(tie_word_embeddings=True)
    model = seeded_model(config, seed=2)
    hf = {k: v.contiguous() for k, v in to_hf_state_dict(model).items()}
    assert "lm_head.weight" not in hf
    names = sorted(hf)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: hf[k] for k in keys}, str(tmp_path / shard))
    weight_map = {k: s for s, ks in shards.items() for k in ks}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    _, loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.arange(20) % config.vocab_size
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_fused_expert_layout_is_accepted() -> None:
    config = small_config()
    model = seeded_model(config, seed=3)
    state = {k: v for k, v in model.state_dict().items() if "w_" not in k}
    for i, layer in enumerate(model.model.layers):
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([layer.mlp.w_gate_EFD, layer.mlp.w_up_EFD], 1)
        state[f"model.layers.{i}.mlp.experts.down_proj"] = layer.mlp.w_down_EDF
    converted = from_hf_state_dict(state, config)
    for name, value in model.state_dict().items():
        assert torch.equal(converted[name], value)


def test_missing_and_misshapen_tensors_are_rejected(tmp_path: Path) -> None:
    config = small_config(num_experts=3)
    save_checkpoint(seeded_model(config), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts 0\.\.2"):
        load_checkpoint(tmp_path)
    bad = dict(config.to_hf_dict(), hidden_size=32)
    save_checkpoint(seeded_model(config), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_checkpoint(tmp_path / "nowhere")


def test_config_validation_and_unsupported_features() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig(num_experts=2, num_experts_per_tok=3)
    base = tiny().to_hf_dict()
    for key, value in [("use_sliding_window", True), ("mlp_only_layers", [1]), ("decoder_sparse_step", 2)]:
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_dict(dict(base, **{key: value}))
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    legacy = {k: v for k, v in base.items() if k not in ("head_dim", "rope_parameters")}
    assert ModelConfig.from_hf_dict(legacy).head_dim == tiny().hidden_size // tiny().num_attention_heads


def test_presets_sizes() -> None:
    assert 2e6 < tiny().num_parameters() < 8e6
    assert 90e6 < medium_100m().num_parameters() < 120e6
    model = MoETransformer(tiny())
    assert sum(p.numel() for p in model.parameters()) == tiny().num_parameters()


def test_experts_fn_is_swappable() -> None:
    model = seeded_model(small_config(), seed=4)
    calls = []

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[1].shape)
        return reference_experts_forward(*args)

    ids = torch.arange(9)
    with torch.no_grad():
        before = model(ids).logits
        model.set_experts_fn(spy)
        after = model(ids).logits
    assert len(calls) == 2 and calls[0] == (9, 2) and torch.equal(before, after)
    assert model.experts_fn is spy
