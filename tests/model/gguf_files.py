"""Small GGUF files written with the `gguf` package's own writer, from transformers models at random init.

Written the way llama.cpp's converter writes them: llama q/k rows permuted for its pair-wise RoPE, norms
in F32, matrices in the type asked for (quantized by `gguf.quants`), a byte-level BPE vocabulary. The
tests load the same file with transformers and with `model.convert`, so neither side is ours alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import pre_tokenizers

Q = GGMLQuantizationType
MATRIX_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{suffix}"


def permute_for_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's order: within each head, HF rows i and i + Hd/2 become rows 2i and 2i + 1."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens (byte-alphabet characters, a few merged pairs, the special tokens), their types, the merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    needed = list("Ġ_.,:()Ċab")
    singles = (needed + [c for c in alphabet if c.isalnum() and c not in needed])[: size - len(SPECIAL) - 4]
    merges = ["Ġ a", "Ġ b", "a b", "Ġa b"]
    merged = ["Ġa", "Ġb", "ab", "Ġab"]
    tokens = [*SPECIAL, *singles, *merged]
    assert len(tokens) == size, (len(tokens), size)
    return tokens, [3] * len(SPECIAL) + [1] * (size - len(SPECIAL)), merges


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    kind: str,
    *,
    matrix_type: Callable[[int], GGMLQuantizationType] = lambda i: MATRIX_TYPES[i % len(MATRIX_TYPES)],
    drop: Iterable[str] = (),
    extra_metadata: dict[str, Any] | None = None,
    replace: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """`model` (a transformers LlamaForCausalLM or Qwen3ForCausalLM) as llama.cpp would write it."""
    cfg = model.config
    writer = GGUFWriter(str(path), kind)  # writes general.architecture itself
    for key, value in [("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("vocab_size", cfg.vocab_size),
                       # llama.cpp writes the head dim as the rotary width for llama, as key/value length for qwen3
                       *([("rope.dimension_count", cfg.head_dim)] if kind == "llama" else
                         [("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim)])]:
        writer.add_uint32(f"{kind}.{key}", value)
    writer.add_float32(f"{kind}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{kind}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_string("general.name", f"tiny {kind}")
    tokens, types, merges = vocabulary(cfg.vocab_size)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    for key, token_id in [("bos_token_id", 1), ("eos_token_id", 2), ("unknown_token_id", 0),
                          ("padding_token_id", 2)]:
        writer.add_uint32(f"tokenizer.ggml.{key}", token_id)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    dropped, num_matrices = set(drop), 0
    for hf, tensor in state.items():
        name = gguf_name(hf)
        if name in dropped:
            continue
        w = tensor.detach().float().numpy()
        if kind == "llama" and ".q_proj." in hf:
            w = permute_for_llama_cpp(w, cfg.num_attention_heads)
        elif kind == "llama" and ".k_proj." in hf:
            w = permute_for_llama_cpp(w, cfg.num_key_value_heads)
        if replace and name in replace:
            data, qtype = replace[name]
            writer.add_tensor(name, data, raw_dtype=qtype)
        elif w.ndim == 1:
            writer.add_tensor(name, w)
        else:  # the i-th matrix gets matrix_type(i): by default the six types in turn
            _add_matrix(writer, name, w, matrix_type(num_matrices))
            num_matrices += 1
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_matrix(writer: GGUFWriter, name: str, w: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, w)
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
