"""Model configuration with Hugging Face `Qwen3MoeConfig` field names, and presets.

`ModelConfig` round-trips through a checkpoint's config.json (`from_hf_dict` / `to_hf_dict`). Features of
Qwen3-MoE this implementation does not support (sliding window, RoPE scaling, dense MLP layers) are
rejected when reading config.json rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.errors import ConfigError

__all__ = ["ModelConfig", "medium_100m", "tiny"]

BYTE_VOCAB_SIZE = 264  # 256 bytes + 8 special tokens, see model.tokenizer.ByteTokenizer

_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "use_sliding_window": False,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
}


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"ModelConfig.{name} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Qwen3-MoE-compatible decoder (every layer is a MoE layer).

    Field names and meanings follow `transformers.Qwen3MoeConfig`.
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 256
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    intermediate_size: int = 512  # dense-MLP width in HF; unused here (all layers are MoE)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
        ):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; pick a divisor for the KV heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}; "
                "lower top-k or add experts"
            )

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Total parameter count (embedding and head counted once when tied)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * hd
        if self.attention_bias:
            attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) + d
        moe = self.num_experts * (3 * d * self.moe_intermediate_size + d)
        layer = attn + moe + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict; unknown HF-only keys are ignored, unsupported features rejected."""
        for key, default in _UNSUPPORTED_IF_SET.items():
            value = raw.get(key, default)
            if value not in (default, None) and not (key == "mlp_only_layers" and not value):
                raise ConfigError(f"config.json {key}={value!r} is not supported; expected {default!r}")
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json rope type {rope_type!r} is not supported; only 'default' RoPE")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in fields}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if "head_dim" not in kwargs or kwargs["head_dim"] is None:
            kwargs["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict that `transformers` loads as a `Qwen3MoeConfig`."""
        out: dict[str, Any] = dataclasses.asdict(self)
        out.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_act="silu",
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
            rope_scaling=None,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_dropout=0.0,
            torch_dtype="float32",
        )
        return out


def tiny() -> ModelConfig:
    """The embedded default policy: byte vocabulary, ~4M parameters, 1024-token context."""
    return ModelConfig()


def medium_100m() -> ModelConfig:
    """A ~105M-parameter configuration (byte vocabulary) for benchmarks and longer CPU runs."""
    return ModelConfig(
        hidden_size=768,
        moe_intermediate_size=320,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
    )
