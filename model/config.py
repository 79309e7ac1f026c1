"""Model configuration with Hugging Face `Qwen3MoeConfig` field names, and presets.

`ModelConfig` round-trips through a checkpoint's config.json (`from_hf_dict` / `to_hf_dict`). Reading is
closed-world: every key of config.json is either read into a field (under its transformers 4.x or 5.x
name: `num_experts` or `num_local_experts`, `rope_theta` or `rope_parameters`), checked against the one
value this implementation supports (sliding window off, default RoPE, every layer MoE, SiLU, no
attention dropout), or known not to change the model's function (bookkeeping such as `use_cache` or
`transformers_version`). Any other key is refused with an error naming it, so a checkpoint never loads
as a different model than the one that was saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.errors import ConfigError

__all__ = ["ModelConfig", "medium_100m", "tiny"]

BYTE_VOCAB_SIZE = 264  # 256 bytes + 8 special tokens, see model.tokenizer.ByteTokenizer

# Keys whose value must be the one this implementation computes (None counts as the default).
_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "use_sliding_window": False,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "is_encoder_decoder": False,
    "pruned_heads": {},
}
# Keys that do not change the function the model computes: bookkeeping, output options, the auxiliary
# router loss (not part of this trainer's loss), and the sliding window's size (the window is off).
_INERT = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "sliding_window", "max_window_layers", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "id2label", "label2id",
    "tokenizer_class", "chunk_size_feed_forward", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
})
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta"})


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
        """Build from a config.json dict (transformers 4.x or 5.x names).

        Raises:
            ConfigError: a key this implementation does not read, an unsupported value, or two names
                of one field (``num_experts`` / ``num_local_experts``, ``rope_theta`` at the top level
                and in ``rope_parameters``) that disagree; the message names the key.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - fields - set(_UNSUPPORTED_IF_SET) - _INERT
                         - {"num_local_experts", "rope_scaling", "rope_parameters", "layer_types"})
        if unknown:
            raise ConfigError(f"config.json keys {unknown} are not read by this Qwen3-MoE implementation and may "
                              "change the model; remove them if they do not, or load the checkpoint elsewhere")
        for key, default in _UNSUPPORTED_IF_SET.items():
            value = raw.get(key, default)
            if value not in (default, None) and not (key in ("mlp_only_layers", "pruned_heads") and not value):
                raise ConfigError(f"config.json {key}={value!r} is not supported; expected {default!r}")
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"config.json layer_types={layer_types!r} is not supported; only 'full_attention'")
        kwargs = {k: v for k, v in raw.items() if k in fields}
        kwargs.update(_hf_experts(raw))
        kwargs.update(_hf_rope(raw))
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


def _hf_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The expert count under either name (transformers 5.x writes ``num_local_experts``)."""
    names = {k: raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None}
    if len(set(names.values())) > 1:
        raise ConfigError(f"config.json gives two expert counts {names}; they must agree")
    return {"num_experts": next(iter(names.values()))} if names else {}


def _hf_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta from the top level or from rope_parameters / rope_scaling; only default RoPE."""
    out: dict[str, Any] = {}
    thetas = {"rope_theta": raw["rope_theta"]} if raw.get("rope_theta") is not None else {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json {key}={rope!r} must be a mapping or null")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json {key} rope type {rope_type!r} is not supported; only 'default' RoPE")
        extra = sorted(set(rope) - _ROPE_KEYS)
        if extra:
            raise ConfigError(f"config.json {key} keys {extra} are not supported (default RoPE reads only "
                              f"rope_type and rope_theta)")
        if rope.get("rope_theta") is not None:
            thetas[f"{key}.rope_theta"] = rope["rope_theta"]
    if len({float(v) for v in thetas.values()}) > 1:
        raise ConfigError(f"config.json gives different RoPE bases {thetas}; they must agree")
    if thetas:
        out["rope_theta"] = next(iter(thetas.values()))
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
