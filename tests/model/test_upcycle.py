"""`model.upcycle`: a dense Llama / Qwen3 checkpoint becomes a Mixtral / Qwen3-MoE computing the same function.

The dense checkpoints are built by transformers at random init and written by its own `save_pretrained`; the
upcycled ones are read back by our loader, by transformers' AutoModelForCausalLM and by the generation engine.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import Architecture, ModelConfig, Upcycling
from model.errors import CheckpointError, ConfigError
from model.transformer import MoETransformer
from model.upcycle import main, upcycle, upcycle_weights, upcycled_config
from tests.model.helpers import engine_greedy, hf_dense_model, random_prompts, seeded_model, small_config

transformers = pytest.importorskip("transformers")

# Copied byte for byte: the upcycler neither parses nor rewrites them.
TOKENIZER = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
             "tokenizer_config.json": '{"chat_template": "{{ messages }}", "eos_token": "<|im_end|>"}\n',
             "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}\n"}
SEQ = 30
REPO = Path(__file__).resolve().parents[2]


def _dense(path: Path, kind: str, seed: int = 0, **overrides: object) -> Path:
    """A random dense checkpoint written by transformers, with tokenizer files beside it."""
    hf_dense_model(kind, seed, **overrides).save_pretrained(str(path))
    for name, text in TOKENIZER.items():
        (path / name).write_text(text)
    return path


def _logits(model: MoETransformer, seed: int = 1) -> torch.Tensor:
    ids = torch.tensor(random_prompts(3, model.config.vocab_size, SEQ, SEQ, seed=seed))
    with torch.no_grad():
        return model.eval()(ids.reshape(-1), seq_lens=[SEQ] * 3).logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize(("kind", "overrides"), [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4,
                                                                "factor": 8.0, "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 16}}),
    ("qwen3", {}),
    ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),  # Qwen3-MoE has attention biases too
])
@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 1), (4, 2), (3, 3)])
def test_the_upcycled_model_computes_the_dense_function(kind: str, overrides: dict[str, object], num_experts: int,
                                                        top_k: int, tmp_path: Path) -> None:
    dense_dir = _dense(tmp_path / "dense", kind, seed=num_experts + top_k, **overrides)
    upcycle(dense_dir, tmp_path / "moe", num_experts, top_k, seed=7)
    dense_config, dense = load_checkpoint(dense_dir)
    config, moe = load_checkpoint(tmp_path / "moe")
    expected = Architecture.MIXTRAL if kind == "llama" else Architecture.QWEN3_MOE
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (expected, num_experts, top_k)
    assert config.moe_intermediate_size == dense_config.intermediate_size and config.norm_topk_prob
    assert config.upcycling == Upcycling(kind, expert_noise_std=0.0, router_std=dense_config.initializer_range, seed=7)
    ids = torch.tensor(random_prompts(3, 96, SEQ, SEQ, seed=1))
    with torch.no_grad():
        out = moe.eval()(ids.reshape(-1), seq_lens=[SEQ] * 3)
    assert _max_diff(out.logits, _logits(dense)) <= 1e-5
    assert out.topk_ids_TLK.unique().numel() == num_experts  # a random router spreads tokens over all experts
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe"), dtype=torch.float32)
    assert type(hf).__name__ == expected.hf_class
    with torch.no_grad():
        assert _max_diff(hf.eval()(ids).logits.reshape(-1, 96), out.logits) <= 1e-5


def test_noise_breaks_the_symmetry_is_recorded_and_keeps_the_routers(tmp_path: Path) -> None:
    dense_dir = _dense(tmp_path / "dense", "llama")
    upcycle(dense_dir, tmp_path / "exact", 4, 2, seed=3)
    upcycle(dense_dir, tmp_path / "noisy", 4, 2, expert_noise_std=0.01, seed=3)
    upcycle(dense_dir, tmp_path / "noisy_again", 4, 2, expert_noise_std=0.01, seed=3)
    upcycle(dense_dir, tmp_path / "other_seed", 4, 2, expert_noise_std=0.01, seed=4)
    raw = json.loads((tmp_path / "noisy" / "config.json").read_text())
    assert raw["upcycling"] == {"dense_architecture": "llama", "expert_noise_std": 0.01, "router_std": 0.05,
                                "seed": 3}
    exact, noisy, again, other = (load_file(str(tmp_path / d / "model.safetensors"))
                                  for d in ("exact", "noisy", "noisy_again", "other_seed"))
    gate, w1 = "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.{}.w1.weight"
    assert torch.equal(exact[gate], noisy[gate]) and not torch.equal(noisy[gate], other[gate])
    assert all(torch.equal(noisy[k], again[k]) for k in noisy)  # the seed reproduces the checkpoint
    assert torch.equal(exact[w1.format(0)], exact[w1.format(3)])
    assert not torch.equal(noisy[w1.format(0)], noisy[w1.format(3)])
    assert 0.005 < float((noisy[w1.format(0)] - exact[w1.format(0)]).std()) < 0.02
    _, dense = load_checkpoint(dense_dir)
    _, moe = load_checkpoint(tmp_path / "noisy")
    assert _max_diff(_logits(moe), _logits(dense)) > 1e-3


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_engine_generates_the_dense_models_greedy_tokens(kind: str, tmp_path: Path) -> None:
    dense_dir = _dense(tmp_path / "dense", kind, seed=11)
    upcycle(dense_dir, tmp_path / "moe", 6, 2, seed=1)
    _, dense = load_checkpoint(dense_dir)
    _, moe = load_checkpoint(tmp_path / "moe")
    prompts = random_prompts(3, 96, 5, 12, seed=2)
    dense_gens, moe_gens = engine_greedy(dense.eval(), prompts, 20), engine_greedy(moe.eval(), prompts, 20)
    assert [g.token_ids for g in moe_gens] == [g.token_ids for g in dense_gens]
    assert all(g.topk_ids_TLK.shape[1:] == (2, 2) for g in moe_gens)


def test_router_replay_of_the_engines_record_reproduces_the_upcycled_forward(tmp_path: Path) -> None:
    upcycle(_dense(tmp_path / "dense", "qwen3", seed=5), tmp_path / "moe", 8, 3, seed=2)
    _, moe = load_checkpoint(tmp_path / "moe")
    prompt = random_prompts(1, 96, 8, 8, seed=3)[0]
    (gen,) = engine_greedy(moe.eval(), [prompt], 12)
    ids = torch.tensor(prompt + list(gen.token_ids))
    with torch.no_grad():
        live = moe(ids)
        replayed = moe(ids, replay_topk_ids_TLK=gen.topk_ids_TLK)  # the last row is -1: never fed, routed live
    assert torch.equal(gen.topk_ids_TLK[:-1].long(), live.topk_ids_TLK[:-1])  # the KV-cache path routes the same
    assert torch.equal(replayed.topk_ids_TLK, live.topk_ids_TLK)
    stats = replayed.routing_stats
    assert (stats.num_replayed_tokens, stats.num_unrecorded_tokens, stats.num_replaced) == ((len(ids) - 1) * 2, 2, 0)
    assert _max_diff(replayed.logits, live.logits) <= 1e-5


def _router_and_expert_grads(model: MoETransformer) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    ids = torch.tensor(random_prompts(1, 96, 64, 64, seed=9)[0])
    torch.nn.functional.cross_entropy(model.train()(ids[:-1]).logits, ids[1:]).backward()
    router = max(float(layer.mlp.gate.weight.grad.abs().max()) for layer in model.model.layers)
    per_expert = model.model.layers[0].mlp.w_up_EFD.grad.flatten(1).abs().sum(1)  # (E,)
    return router, per_expert


def test_a_random_router_trains_every_expert_where_a_zero_router_would_train_k_copies(tmp_path: Path) -> None:
    """Why the router is drawn at random: at step 0 its gradient is zero either way (the experts are equal
    and the gates sum to 1), but a random router gives the experts different tokens, so they drift apart;
    a zero router gives every token the same K experts, whose equal gradients keep them copies forever."""
    _, dense = load_checkpoint(_dense(tmp_path / "dense", "llama", seed=3))
    moe = upcycle_weights(dense, upcycled_config(dense.config, 4, 2, seed=0))
    router, per_expert = _router_and_expert_grads(moe)
    assert router <= 1e-6 and bool((per_expert > 0).all())
    with torch.no_grad():
        for layer in moe.model.layers:
            layer.mlp.gate.weight.zero_()
    _, per_expert = _router_and_expert_grads(moe)
    assert int((per_expert > 0).sum()) == 2


def test_the_command_line_upcycles_and_copies_the_tokenizer_unchanged(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    dense_dir = _dense(tmp_path / "dense", "qwen3")
    out = tmp_path / "moe"
    ok = subprocess.run([sys.executable, "-m", "model.upcycle", str(dense_dir), str(out), "--experts", "4", "--top-k",
                         "2", "--noise", "0.001", "--seed", "5"], cwd=REPO, capture_output=True, text=True, timeout=300,
                        check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1] == str(out)  # the path last, after the log events
    for name, text in TOKENIZER.items():
        assert (out / name).read_text() == text
    config, _ = load_checkpoint(out)
    assert config.upcycling == Upcycling("qwen3", expert_noise_std=0.001, router_std=0.05, seed=5)
    assert main([str(dense_dir), str(out), "--experts", "4", "--top-k", "2"]) == 2  # out exists
    assert "already exists" in capsys.readouterr().err
    assert main([str(dense_dir), str(tmp_path / "bad"), "--experts", "2", "--top-k", "3"]) == 2
    assert "num_experts_per_tok=3" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "moe"]  # no partial directory left


@pytest.mark.parametrize(("kind", "overrides", "named"), [
    ("llama", {"mlp_bias": True}, "mlp_bias"),  # experts have no biases
    ("llama", {"attention_bias": True}, "attention_bias"),  # Mixtral's attention has none
])
def test_dense_checkpoints_that_cannot_be_upcycled_exactly_are_refused(kind: str, overrides: dict[str, object],
                                                                        named: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=named):
        upcycle(_dense(tmp_path / "dense", kind, **overrides), tmp_path / "moe", 4, 2)
    assert not (tmp_path / "moe").exists()


def test_a_moe_checkpoint_is_refused(tmp_path: Path) -> None:
    save_checkpoint(seeded_model(small_config()), tmp_path / "moe_in")
    with pytest.raises(ConfigError, match="already a MoE"):
        upcycle(tmp_path / "moe_in", tmp_path / "out", 4, 2)


@pytest.mark.parametrize(("num_experts", "top_k", "noise", "seed", "named"), [
    (0, 1, 0.0, 0, "num_experts=0"),
    (4, 0, 0.0, 0, "num_experts_per_tok=0"),
    (4, 5, 0.0, 0, "num_experts_per_tok=5"),
    (4, 2, -0.1, 0, "expert_noise_std"),
    (4, 2, float("nan"), 0, "expert_noise_std"),
    (4, 2, 0.0, -1, "seed"),
])
def test_out_of_range_arguments_are_refused_by_name(num_experts: int, top_k: int, noise: float, seed: int,
                                                    named: str) -> None:
    dense = ModelConfig(architecture="llama", num_experts=0, num_experts_per_tok=0)
    with pytest.raises(ConfigError, match=named):
        upcycled_config(dense, num_experts, top_k, noise, seed)


def test_a_missing_source_or_an_existing_output_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        upcycle(tmp_path / "nowhere", tmp_path / "out", 4, 2)
    dense_dir = _dense(tmp_path / "dense", "llama")
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        upcycle(dense_dir, tmp_path / "out", 4, 2)


@pytest.mark.parametrize(("change", "named"), [
    ({"norm_topk_prob": False}, "norm_topk_prob"),  # gates summing to < 1 would scale the dense MLP down
    ({"moe_intermediate_size": 48}, "moe_intermediate_size"),
    ({"upcycling": None}, "upcycling"),
    ({"rms_norm_eps": 1e-3}, "rms_norm_eps"),
])
def test_target_configs_that_are_not_an_exact_upcycle_are_refused(change: dict[str, object], named: str) -> None:
    dense = seeded_model(ModelConfig(architecture="qwen3", num_experts=0, num_experts_per_tok=0, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1, head_dim=16))
    target = dataclasses.replace(upcycled_config(dense.config, 4, 2), **change)
    with pytest.raises(ConfigError, match=named):
        upcycle_weights(dense, target)
    mixtral = dataclasses.replace(upcycled_config(dense.config, 4, 2), architecture="mixtral", attention_bias=False)
    with pytest.raises(ConfigError, match="upcycles into qwen3_moe"):
        upcycle_weights(dense, mixtral)


def test_the_upcycling_record_is_read_only_from_moe_configs_and_only_whole() -> None:
    record = {"dense_architecture": "llama", "expert_noise_std": 0.0, "router_std": 0.02, "seed": 0}
    moe = small_config().to_hf_dict()
    assert ModelConfig.from_hf_dict({**moe, "upcycling": record}).upcycling == Upcycling(**record)
    dense = ModelConfig(architecture="llama", num_experts=0, num_experts_per_tok=0).to_hf_dict()
    with pytest.raises(ConfigError, match="upcycling"):
        ModelConfig.from_hf_dict({**dense, "upcycling": record})
    for bad in ({**record, "extra": 1}, {k: v for k, v in record.items() if k != "seed"}, [record]):
        with pytest.raises(ConfigError, match="upcycling"):
            ModelConfig.from_hf_dict({**moe, "upcycling": bad})
    with pytest.raises(ConfigError, match="dense_architecture"):
        ModelConfig.from_hf_dict({**moe, "upcycling": {**record, "dense_architecture": "qwen3_moe"}})
    with pytest.raises(ConfigError, match="dense but upcycling"):
        ModelConfig(architecture="llama", num_experts=0, num_experts_per_tok=0, upcycling=Upcycling(**record))
