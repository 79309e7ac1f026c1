"""A GGUF checkpoint (llama.cpp's file format) read as a Hugging Face config.json and HF-named fp32 tensors.

Legend: H query heads, Hkv key/value heads, Hd head dim, D hidden size.

Reading goes through the `gguf` package (llama.cpp's own reader and dequantizers). Closed-world like
`model.config`: every metadata key is read (`{arch}.*` into config.json, `tokenizer.*` by
`model.gguf_tokenizer`), checked, or descriptive (`general.*`: name, license, file type; the reader's own
`GGUF.*` counts); every tensor maps to one parameter of the model the config describes, with that
parameter's shape. Anything else is a `CheckpointError` naming the key or tensor.

llama.cpp stores Llama's q_proj and k_proj rows permuted for its RoPE, which rotates adjacent pairs
(x[2i], x[2i+1]) where Hugging Face rotates halves (x[i], x[i + Hd/2]): within each head the GGUF row
2i + j holds HF row i + j·Hd/2. `_unpermute_rope_rows` puts them back. Qwen3 files are not permuted
(llama.cpp converts them with the halves layout).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from model.config import Architecture, ModelConfig
from model.errors import CheckpointError
from model.gguf_tokenizer import TOKENIZER_KEYS
from model.transformer import MoETransformer

__all__ = ["SUPPORTED_TENSOR_TYPES", "GGUFCheckpoint", "read_gguf"]

SUPPORTED_TENSOR_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
})
_ARCHITECTURES = {"llama": Architecture.LLAMA, "qwen3": Architecture.QWEN3}
# `{arch}.<key>` -> config.json key
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# Each of these, when present, is the head dim (llama.cpp writes whichever its converter knew).
_HEAD_DIM_KEYS = ("rope.dimension_count", "attention.key_length", "attention.value_length")
_READER_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """What a GGUF file holds, in the policy's terms: its config, HF-named fp32 tensors, raw metadata."""

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]


class _NamingReader(GGUFReader):
    """GGUFReader whose failures name the tensor or key they hit.

    The reader maps every tensor eagerly; a file cut short fails inside numpy ("cannot reshape array ...")
    with no tensor named. Each tensor's extent is checked against the file's size first, and a header that
    breaks is reported with the last metadata key read whole.
    """

    def __init__(self, path: Path) -> None:
        try:
            super().__init__(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        except (ValueError, IndexError, OverflowError, UnicodeDecodeError) as exc:
            keys = list(getattr(self, "fields", {}))  # the keys parsed before the failure, in file order
            where = f"after metadata key {keys[-1]!r}" if keys else "in its header"
            raise CheckpointError(f"{path}: not a readable GGUF file: it ends or breaks {where} ({exc})") from exc

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = int(self.data.shape[0])
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise CheckpointError(f"tensor {name!r} has unknown GGML type id {int(raw_type[0])}") from None
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise CheckpointError(f"tensor {name!r} ends at byte {end} but the file has {size} bytes: the "
                                      "GGUF is truncated; download it again")
        super()._build_tensors(start_offs, fields)


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    return _NamingReader(path)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _config(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """config.json from `{arch}.*` keys and the tensors present (tied head, biases)."""
    arch_name = metadata.get("general.architecture")
    if arch_name not in _ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture={arch_name!r} is not supported; "
                              f"expected one of {sorted(_ARCHITECTURES)}")
    arch, prefix = _ARCHITECTURES[arch_name], f"{arch_name}."
    known = {prefix + k for k in (*_CONFIG_KEYS, *_HEAD_DIM_KEYS)} | TOKENIZER_KEYS | _READER_KEYS
    unknown = sorted(k for k in metadata if k not in known and not k.startswith("general."))
    if unknown:
        raise CheckpointError(f"{path}: GGUF metadata keys {unknown} are not read by this converter and may "
                              f"change the model (rope scaling, experts, sliding windows)")
    config: dict[str, Any] = {"model_type": arch.value, "architectures": [arch.hf_class]}
    for key, name in _CONFIG_KEYS.items():
        if prefix + key in metadata:
            config[name] = metadata[prefix + key]
    missing = [prefix + k for k, name in _CONFIG_KEYS.items() if name not in config and k != "vocab_size"]
    if missing:
        raise CheckpointError(f"{path}: GGUF metadata lacks {missing}")
    config.setdefault("vocab_size", len(metadata.get("tokenizer.ggml.tokens") or ()))
    head_dims = {prefix + k: metadata[prefix + k] for k in _HEAD_DIM_KEYS if prefix + k in metadata}
    if len(set(head_dims.values())) > 1:
        raise CheckpointError(f"{path}: {head_dims} disagree; partial rotary or unequal key/value heads are "
                              "not supported")
    config["head_dim"] = next(iter(head_dims.values()), config["hidden_size"] // config["num_attention_heads"])
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch is Architecture.LLAMA:
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        config[name] = metadata.get(f"tokenizer.ggml.{key}")
    return config


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR.match(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}.{match.group(3)}"
    return None


def _gguf_name(hf_name: str) -> str:
    """The GGUF name llama.cpp gives a parameter (for messages about missing tensors)."""
    for gguf_name, hf in _GLOBAL_TENSORS.items():
        if hf == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    short = {v: k for k, v in _BLOCK_TENSORS.items()}[module]
    return f"blk.{layer}.{short}.{suffix}"


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs interleaved) to Hugging Face's (halves): see the module doc."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = MoETransformer(config)
    return {k: v.shape for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and config.tie_word_embeddings)}


def _tensors(reader: GGUFReader, config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 under its HF name, after checking names, types and shapes."""
    expected = _expected_shapes(config)
    by_hf: dict[str, Any] = {}
    for tensor in reader.tensors:
        hf = _hf_name(tensor.name)
        if hf is None or hf not in expected:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} has no place in a {config.architecture.value} "
                                  f"model with this config")
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}; supported: "
                                  f"{sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGML lists the fastest dim first
        if shape != tuple(expected[hf]):
            raise CheckpointError(f"{path}: tensor {tensor.name!r} has shape {shape}; the config needs "
                                  f"{tuple(expected[hf])} for {hf}")
        by_hf[hf] = tensor
    missing = sorted(set(expected) - set(by_hf))
    if missing:
        named = [f"{_gguf_name(hf)} ({hf})" for hf in missing[:8]]
        raise CheckpointError(f"{path}: {len(missing)} tensors missing: {', '.join(named)}")
    out: dict[str, torch.Tensor] = {}
    for hf, tensor in by_hf.items():
        w = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        w = w.reshape(expected[hf])
        if config.architecture is Architecture.LLAMA and ".self_attn.q_proj." in hf:
            w = _unpermute_rope_rows(w, config.num_attention_heads)
        elif config.architecture is Architecture.LLAMA and ".self_attn.k_proj." in hf:
            w = _unpermute_rope_rows(w, config.num_key_value_heads)
        out[hf] = w
    return out


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read, check and dequantize a GGUF checkpoint (llama or qwen3 architecture).

    Raises:
        CheckpointError: the file is missing or truncated, a metadata key or tensor is not one this converter
            reads, a tensor is missing, has another shape than the config implies, or an unsupported type.
        ConfigError: the config the metadata describes is one the policy does not support.
    """
    file = Path(path)
    reader = _open(file)
    metadata = _metadata(reader)
    raw = _config(metadata, {t.name for t in reader.tensors}, file)
    config = ModelConfig.from_hf_dict(raw)
    return GGUFCheckpoint(file, config, _tensors(reader, config, file), metadata)
