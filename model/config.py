"""Model configuration with Hugging Face field names (Qwen3-MoE, Mixtral, Qwen3, Llama), and presets.

`ModelConfig` round-trips through a checkpoint's config.json (`from_hf_dict` / `to_hf_dict`, implemented
at the end of this module). Reading is closed-world: every key of config.json is read into a field, checked
against the one value this implementation supports, or known not to change the model's function; any
other key is refused with an error naming it, so a checkpoint never loads as a different model than the
one that was saved.

Four architectures share one decoder (`model.transformer`): `qwen3_moe` (every layer a MoE block, q/k
RMSNorm), `mixtral` (every layer a MoE block, Llama attention: no q/k norm, no biases, top-k gates always
renormalised), `qwen3` (dense SwiGLU MLP, q/k RMSNorm) and `llama` (dense SwiGLU MLP, no q/k norm). A dense
architecture has no experts: its `num_experts` and `num_experts_per_tok` are 0, so the router capture of
a forward is (T, L, 0). Mixtral exists here as the MoE a Llama upcycles into (`model.upcycle`): Qwen3-MoE's
q/k norm would change a Llama's function.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from model.errors import ConfigError

__all__ = ["Architecture", "Llama3RopeScaling", "ModelConfig", "Upcycling", "medium_100m", "tiny"]

BYTE_VOCAB_SIZE = 264  # 256 bytes + 8 special tokens, see model.tokenizer.ByteTokenizer


class Architecture(enum.StrEnum):
    """The transformers `model_type` a configuration is written and read as."""

    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"
    QWEN3 = "qwen3"
    LLAMA = "llama"

    @property
    def is_moe(self) -> bool:
        return self in (Architecture.QWEN3_MOE, Architecture.MIXTRAL)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises every query and key head (RMSNorm over Hd) before RoPE; Llama and Mixtral do not."""
        return self in (Architecture.QWEN3_MOE, Architecture.QWEN3)

    @property
    def hf_class(self) -> str:
        return {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "llama": "LlamaForCausalLM"}[self]


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (transformers `rope_type="llama3"`).

    Frequencies whose wavelength exceeds `original_max_position_embeddings / low_freq_factor` are divided
    by `factor`, those shorter than `original_max_position_embeddings / high_freq_factor` are kept, and the
    band between is interpolated (see `model.layers.llama3_inv_freq`).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _positive(f"rope_scaling.{name}", getattr(self, name))
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor (the interpolation band divides "
                f"by their difference), got high_freq_factor={self.high_freq_factor}, "
                f"low_freq_factor={self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class Upcycling:
    """How a MoE checkpoint was made from a dense one (`model.upcycle`), kept in its config.json as provenance.

    It does not change the function the checkpoint computes (the weights say everything); it is recorded so
    that a run started from an upcycled policy can say how its experts were initialised and reproduce them.

    Args:
        dense_architecture: the architecture of the dense checkpoint (`llama` or `qwen3`).
        expert_noise_std: std of the Gaussian noise added to every expert weight (0: exact copies).
        router_std: std of the router's Gaussian init.
        seed: seed of the generator both were drawn from.
    """

    dense_architecture: str
    expert_noise_std: float
    router_std: float
    seed: int

    def __post_init__(self) -> None:
        if self.dense_architecture not in (Architecture.LLAMA, Architecture.QWEN3):
            raise ConfigError(f"upcycling.dense_architecture={self.dense_architecture!r} must be 'llama' or 'qwen3'")
        for name in ("expert_noise_std", "router_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ConfigError(f"upcycling.{name}={value!r} must be a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"upcycling.seed={self.seed!r} must be an integer >= 0")


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"ModelConfig.{name} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the decoder. Field names and meanings follow transformers' configs.

    `moe_intermediate_size`, `num_experts`, `num_experts_per_tok` and `norm_topk_prob` describe the MoE
    block (`qwen3_moe`, `mixtral`); `intermediate_size` and `mlp_bias` the dense MLP (`qwen3`, `llama`).
    Mixtral has one MLP width (its config.json `intermediate_size` is the experts'), so for it
    `intermediate_size` must equal `moe_intermediate_size`. `upcycling` records how a MoE checkpoint was
    made from a dense one (None otherwise).
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
    intermediate_size: int = 512  # dense-MLP width; unused by qwen3_moe (every layer is MoE)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    architecture: Architecture = Architecture.QWEN3_MOE
    mlp_bias: bool = False  # llama only: biases on gate/up/down projections
    rope_scaling: Llama3RopeScaling | None = None
    upcycling: Upcycling | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "architecture", Architecture(self.architecture))
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
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
        if self.architecture.is_moe:
            self._check_moe()
        else:
            self._check_dense()

    def _check_moe(self) -> None:
        for name in ("moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            _positive(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}; "
                "lower top-k or add experts"
            )
        if self.mlp_bias:
            raise ConfigError(f"mlp_bias=True is a llama option; {self.architecture.value} experts have no biases")
        if self.architecture is Architecture.MIXTRAL:
            self._check_mixtral()

    def _check_mixtral(self) -> None:
        if self.attention_bias:
            raise ConfigError("attention_bias=True is not a mixtral option: its q/k/v/o projections have no biases")
        if not self.norm_topk_prob:
            raise ConfigError("norm_topk_prob=False is not a mixtral option: mixtral always renormalises its top-k "
                              "gates; use qwen3_moe for raw gates")
        if self.intermediate_size != self.moe_intermediate_size:
            raise ConfigError(
                f"mixtral has one MLP width but intermediate_size={self.intermediate_size} != "
                f"moe_intermediate_size={self.moe_intermediate_size}; pass the expert width for both"
            )

    def _check_dense(self) -> None:
        _positive("intermediate_size", self.intermediate_size)
        if self.num_experts or self.num_experts_per_tok:
            raise ConfigError(
                f"architecture={self.architecture.value!r} is dense but num_experts={self.num_experts}, "
                f"num_experts_per_tok={self.num_experts_per_tok}; pass 0 for both (or use qwen3_moe)"
            )
        if self.mlp_bias and self.architecture is not Architecture.LLAMA:
            raise ConfigError(f"mlp_bias=True is a llama option; {self.architecture.value} MLPs have no biases")
        if self.upcycling is not None:
            raise ConfigError(f"architecture={self.architecture.value!r} is dense but upcycling={self.upcycling}; "
                              "only a MoE checkpoint is upcycled")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.architecture.is_moe

    @property
    def qk_norm(self) -> bool:
        return self.architecture.qk_norm

    def num_parameters(self) -> int:
        """Total parameter count (embedding and head counted once when tied)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.qk_norm:
            attn += 2 * hd
        if self.attention_bias:
            attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) + d
        if self.is_moe:
            mlp = self.num_experts * (3 * d * self.moe_intermediate_size + d)
        else:
            mlp = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x or 5.x names; see `model._hf_config`).

        Raises:
            ConfigError: a key this implementation does not read, an unsupported value, or two names
                of one field (``num_experts`` / ``num_local_experts``, ``rope_theta`` at the top level
                and in ``rope_parameters``) that disagree; the message names the key.
        """
        return cls(**_read_hf_config(raw))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict that `transformers` loads as this architecture's config class."""
        return _write_hf_config(self)


# --- config.json, closed-world --------------------------------------------------------------------------
# Keys every architecture reads into a ModelConfig field of the same name.
_COMMON_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "initializer_range",
    "intermediate_size", "bos_token_id", "eos_token_id", "pad_token_id",
})
_FIELDS = {
    Architecture.QWEN3_MOE: _COMMON_FIELDS | {"moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob"},
    # Mixtral's q/k/v/o have no biases (no attention_bias key); its intermediate_size is the experts' width.
    Architecture.MIXTRAL: (_COMMON_FIELDS - {"attention_bias", "intermediate_size"}) | {"num_experts_per_tok"},
    Architecture.QWEN3: _COMMON_FIELDS,
    Architecture.LLAMA: _COMMON_FIELDS | {"mlp_bias"},
}
# Keys whose value must be the one this implementation computes (None counts as the default).
_COMMON_CHECKED: dict[str, Any] = {
    "hidden_act": "silu", "attention_dropout": 0.0, "is_encoder_decoder": False, "pruned_heads": {},
}
_CHECKED = {
    Architecture.QWEN3_MOE: _COMMON_CHECKED | {"use_sliding_window": False, "mlp_only_layers": [],
                                               "decoder_sparse_step": 1},
    # Mixtral's window is on whenever sliding_window is set; its router jitter multiplies the MoE input in training.
    Architecture.MIXTRAL: _COMMON_CHECKED | {"sliding_window": None, "router_jitter_noise": 0.0},
    Architecture.QWEN3: _COMMON_CHECKED | {"use_sliding_window": False},
    Architecture.LLAMA: _COMMON_CHECKED,
}
# Keys that do not change the function the model computes: bookkeeping, output options, the auxiliary
# router loss (not part of this trainer's loss), the sliding window's size (the window is off), Llama's
# tensor-parallel slicing of its matmuls (the same products, summed).
_COMMON_INERT = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "id2label",
    "label2id", "tokenizer_class", "chunk_size_feed_forward", "tie_encoder_decoder", "is_decoder",
    "add_cross_attention",
})
_INERT = {
    Architecture.QWEN3_MOE: _COMMON_INERT | {"output_router_logits", "router_aux_loss_coef", "sliding_window",
                                             "max_window_layers"},
    Architecture.MIXTRAL: _COMMON_INERT | {"output_router_logits", "router_aux_loss_coef"},
    Architecture.QWEN3: _COMMON_INERT | {"sliding_window", "max_window_layers"},
    Architecture.LLAMA: _COMMON_INERT | {"pretraining_tp"},
}
# Keys read by a helper below rather than copied into a field (`upcycling`: this project's own, see Upcycling).
_SPECIAL = {
    Architecture.QWEN3_MOE: frozenset({"num_experts", "num_local_experts", "rope_theta", "rope_scaling",
                                       "rope_parameters", "layer_types", "upcycling"}),
    Architecture.MIXTRAL: frozenset({"num_experts", "num_local_experts", "intermediate_size", "rope_theta",
                                     "rope_scaling", "rope_parameters", "upcycling"}),
    Architecture.QWEN3: frozenset({"rope_theta", "rope_scaling", "rope_parameters", "layer_types"}),
    Architecture.LLAMA: frozenset({"rope_theta", "rope_scaling", "rope_parameters"}),
}
# RoPE base when config.json gives none (transformers' `default_theta` of the config class).
_DEFAULT_THETA = {Architecture.MIXTRAL: 1e6}
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _architecture(raw: dict[str, Any]) -> Architecture:
    model_type = raw.get("model_type") or Architecture.QWEN3_MOE.value  # older files of this project had none
    try:
        return Architecture(model_type)
    except ValueError:
        raise ConfigError(f"config.json model_type={model_type!r} is not supported; expected one of "
                          f"{[a.value for a in Architecture]}") from None


def _read_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a config.json dict, refusing what this implementation cannot run."""
    arch = _architecture(raw)
    unknown = sorted(set(raw) - _FIELDS[arch] - set(_CHECKED[arch]) - _INERT[arch] - _SPECIAL[arch])
    if unknown:
        raise ConfigError(f"config.json keys {unknown} are not read by this {arch.value} implementation and may "
                          "change the model; remove them if they do not, or load the checkpoint elsewhere")
    for key, default in _CHECKED[arch].items():
        value = raw.get(key, default)
        if value not in (default, None) and not (key in ("mlp_only_layers", "pruned_heads") and not value):
            raise ConfigError(f"config.json {key}={value!r} is not supported; expected {default!r}")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"config.json layer_types={layer_types!r} is not supported; only 'full_attention'")
    kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in _FIELDS[arch]}
    kwargs["architecture"] = arch
    if arch.is_moe:
        kwargs.update(_hf_experts(raw))
        kwargs.update(_hf_upcycling(raw))
    else:
        kwargs.update(num_experts=0, num_experts_per_tok=0)
    if arch is Architecture.MIXTRAL:
        if raw.get("intermediate_size") is None:
            raise ConfigError("mixtral config.json lacks intermediate_size (the experts' width)")
        kwargs.update(intermediate_size=raw["intermediate_size"], moe_intermediate_size=raw["intermediate_size"])
    if arch in _DEFAULT_THETA:
        kwargs["rope_theta"] = _DEFAULT_THETA[arch]
    kwargs.update(_hf_rope(raw))
    if kwargs.get("head_dim") is None:
        kwargs["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    return kwargs


def _write_hf_config(config: ModelConfig) -> dict[str, Any]:
    arch = config.architecture
    out: dict[str, Any] = {k: getattr(config, k) for k in sorted(_FIELDS[arch])}
    if config.upcycling is not None:
        out["upcycling"] = dataclasses.asdict(config.upcycling)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta,
                **dataclasses.asdict(config.rope_scaling)}
    out.update(
        architectures=[arch.hf_class], model_type=arch.value, hidden_act="silu", attention_dropout=0.0,
        rope_theta=config.rope_theta, rope_scaling=None, rope_parameters=rope, torch_dtype="float32",
    )
    if arch is Architecture.MIXTRAL:
        out.update(intermediate_size=config.moe_intermediate_size, num_local_experts=config.num_experts,
                   sliding_window=None, router_jitter_noise=0.0)
    elif arch.is_moe:
        out.update(num_experts=config.num_experts, decoder_sparse_step=1, mlp_only_layers=[])
    if arch in (Architecture.QWEN3_MOE, Architecture.QWEN3):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def _hf_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The expert count under either name (transformers 5.x writes ``num_local_experts``)."""
    names = {k: raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None}
    if len(set(names.values())) > 1:
        raise ConfigError(f"config.json gives two expert counts {names}; they must agree")
    return {"num_experts": next(iter(names.values()))} if names else {}


def _hf_upcycling(raw: dict[str, Any]) -> dict[str, Any]:
    """The `upcycling` record (exactly Upcycling's fields) or nothing."""
    record = raw.get("upcycling")
    if record is None:
        return {}
    names = {f.name for f in dataclasses.fields(Upcycling)}
    if not isinstance(record, dict) or set(record) != names:
        keys = sorted(record) if isinstance(record, dict) else record
        raise ConfigError(f"config.json upcycling={keys!r} must be a mapping of exactly {sorted(names)}")
    return {"upcycling": Upcycling(**record)}


def _rope_entry(key: str, rope: Any) -> tuple[float | None, Llama3RopeScaling | None]:
    """(rope_theta, scaling) of one rope_parameters / rope_scaling mapping; only default and llama3 RoPE."""
    if not rope:
        return None, None
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json {key}={rope!r} must be a mapping or null")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"config.json {key} rope type {rope_type!r} is not supported; only {list(_ROPE_TYPES)}")
    allowed = {"rope_type", "type", "rope_theta"} | (set(_LLAMA3_KEYS) if rope_type == "llama3" else set())
    extra = sorted(set(rope) - allowed)
    if extra:
        raise ConfigError(f"config.json {key} keys {extra} are not supported ({rope_type} RoPE reads only "
                          f"{sorted(allowed)})")
    scaling = None
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if rope.get(k) is None]
        if missing:
            raise ConfigError(f"config.json {key} (llama3 RoPE) lacks {missing}")
        scaling = Llama3RopeScaling(**{k: rope[k] for k in _LLAMA3_KEYS})
    return rope.get("rope_theta"), scaling


def _hf_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta from the top level or from rope_parameters / rope_scaling, and llama3 scaling; they must agree."""
    thetas = {"rope_theta": raw["rope_theta"]} if raw.get("rope_theta") is not None else {}
    scalings: dict[str, Llama3RopeScaling | None] = {}
    for key in ("rope_parameters", "rope_scaling"):
        theta, scaling = _rope_entry(key, raw.get(key))
        if theta is not None:
            thetas[f"{key}.rope_theta"] = theta
        if raw.get(key):
            scalings[key] = scaling
    if len({float(v) for v in thetas.values()}) > 1:
        raise ConfigError(f"config.json gives different RoPE bases {thetas}; they must agree")
    if len(set(scalings.values())) > 1:
        raise ConfigError(f"config.json gives different RoPE scalings {scalings}; they must agree")
    out: dict[str, Any] = {}
    if thetas:
        out["rope_theta"] = next(iter(thetas.values()))
    if scalings:
        out["rope_scaling"] = next(iter(scalings.values()))
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
