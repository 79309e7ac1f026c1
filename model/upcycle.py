"""`python -m model.upcycle DENSE_DIR OUT_DIR --experts E --top-k K`: sparse upcycling of a dense checkpoint.

Legend: L layers, E experts, K experts per token, D hidden size, I the dense MLP's width (each expert's).

Every expert of every layer starts as a copy of the dense layer's SwiGLU MLP, and everything else
(embeddings, attention, norms, head) is copied as it is, so the MoE checkpoint computes the dense model's
function at step 0: a token's K gates are renormalised to sum to 1 and all experts are equal, so
sum_k g_k * mlp(x) = mlp(x) whatever the router says. A Qwen3 becomes a `qwen3_moe`; a Llama becomes a
`mixtral` (Llama attention: Qwen3-MoE's q/k norm would change its function).

The router is initialised at random (N(0, initializer_range), seeded), not at zero. With a zero router
every token's probabilities tie, top-k breaks the tie the same way for all tokens (and differently on
different devices), so the same K experts get every token and identical gradients: they stay identical
copies, the output never depends on the router, its gradient stays zero, and the other E - K experts are
never trained. A random router spreads tokens over all experts, so the experts see different data and
drift apart, and the router then learns from their differences. `--noise STD` adds N(0, STD) to every
expert weight on top (the function at step 0 then differs from the dense one by about that much).

How the experts were made (dense architecture, noise, router std, seed) is recorded in config.json under
`upcycling` (`model.config.Upcycling`). The tokenizer files and chat template are copied unchanged. What
cannot be upcycled exactly is refused, naming the key: a MoE input, Llama's `mlp_bias` (the experts have
no biases), a Llama with `attention_bias` (Mixtral's attention has none), E < 1, K < 1 or K > E.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import structlog
import torch

from model.checkpoint import load_checkpoint, load_state_into, staged_directory, to_hf_state_dict, write_checkpoint
from model.config import Architecture, ModelConfig, Upcycling
from model.convert import copy_tokenizer
from model.errors import CheckpointError, ConfigError, ModelError
from model.transformer import MoETransformer

__all__ = ["main", "upcycle", "upcycle_weights", "upcycled_config"]

log = structlog.get_logger(__name__)

# The MoE architecture each dense one upcycles into: the same attention, so the same function.
_MOE_OF = {Architecture.QWEN3: Architecture.QWEN3_MOE, Architecture.LLAMA: Architecture.MIXTRAL}
# ModelConfig fields that describe the MLP block, set by upcycling; every other field is the dense model's.
_MLP_FIELDS = frozenset({"architecture", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                         "moe_intermediate_size", "intermediate_size", "upcycling"})
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_dense(dense: ModelConfig) -> None:
    if dense.architecture not in _MOE_OF:
        raise ConfigError(f"architecture={dense.architecture.value!r} is already a MoE; upcycle a dense "
                          f"checkpoint ({' or '.join(a.value for a in _MOE_OF)})")
    if dense.mlp_bias:
        raise ConfigError("mlp_bias=True: the dense MLP has biases but MoE experts have none; upcycle a "
                          "checkpoint without MLP biases")
    if dense.architecture is Architecture.LLAMA and dense.attention_bias:
        raise ConfigError("attention_bias=True: a Llama upcycles into Mixtral, whose attention has no biases; "
                          "upcycle a checkpoint without attention biases")


def upcycled_config(
    dense: ModelConfig, num_experts: int, top_k: int, expert_noise_std: float = 0.0, seed: int = 0
) -> ModelConfig:
    """The MoE config a dense `config` upcycles into: E experts of the dense MLP's width, top-k `top_k`.

    Raises:
        ConfigError: the dense config cannot be upcycled exactly, or E, K, the noise or the seed are out of
            range; the message names the key.
    """
    _check_dense(dense)
    if num_experts < 1:
        raise ConfigError(f"num_experts={num_experts} must be >= 1 (--experts)")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}] (--top-k)")
    record = Upcycling(dense_architecture=dense.architecture.value, expert_noise_std=expert_noise_std,
                       router_std=dense.initializer_range, seed=seed)
    width = dense.intermediate_size
    return dataclasses.replace(dense, architecture=_MOE_OF[dense.architecture], num_experts=num_experts,
                               num_experts_per_tok=top_k, norm_topk_prob=True, moe_intermediate_size=width,
                               intermediate_size=width, upcycling=record)


def _check_target(dense: ModelConfig, config: ModelConfig) -> Upcycling:
    """The upcycling record of `config`, after checking that `config` upcycles `dense` exactly."""
    _check_dense(dense)
    if config.upcycling is None:
        raise ConfigError("upcycling=None: the MoE config carries no upcycling record (noise, router std, seed); "
                          "build it with upcycled_config")
    if config.architecture is not _MOE_OF[dense.architecture]:
        raise ConfigError(f"architecture={config.architecture.value!r}: a {dense.architecture.value} upcycles into "
                          f"{_MOE_OF[dense.architecture].value} (the same attention)")
    if not config.norm_topk_prob:
        raise ConfigError("norm_topk_prob=False: a token's K gates would sum to less than 1, so K copies of the "
                          "dense MLP would not add up to it; upcycle with norm_topk_prob=True")
    if config.moe_intermediate_size != dense.intermediate_size:
        raise ConfigError(f"moe_intermediate_size={config.moe_intermediate_size}: each expert is a copy of the dense "
                          f"MLP, of width intermediate_size={dense.intermediate_size}")
    differ = sorted(f.name for f in dataclasses.fields(ModelConfig)
                    if f.name not in _MLP_FIELDS and getattr(config, f.name) != getattr(dense, f.name))
    if differ:
        raise ConfigError(f"the MoE config differs from the dense one in {differ}; only the MLP block may change")
    return config.upcycling


@torch.no_grad()
def upcycle_weights(dense: MoETransformer, config: ModelConfig) -> MoETransformer:
    """A MoE model of `config` (see `upcycled_config`) whose every expert is `dense`'s MLP of that layer.

    The routers are drawn first (layer order), then the noise, from one generator seeded by the record, so
    a noisy upcycle has the same routers as a noise-free one of the same seed.

    Raises:
        ConfigError: `config` is not an exact upcycle of `dense.config` (the key named).
    """
    record = _check_target(dense.config, config)
    gen = torch.Generator().manual_seed(record.seed)
    e, d = config.num_experts, config.hidden_size
    dense_state = {k: v.detach().float() for k, v in dense.state_dict().items()}  # noise is drawn and added in fp32
    state = {k: v for k, v in dense_state.items() if ".mlp." not in k}
    for i in range(config.num_hidden_layers):
        state[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(e, d, generator=gen) * record.router_std
    for i in range(config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp"
        for stacked, proj in (("w_gate_EFD", "gate_proj"), ("w_up_EFD", "up_proj"), ("w_down_EDF", "down_proj")):
            w_EXY = dense_state[f"{mlp}.{proj}.weight"].unsqueeze(0).repeat(e, 1, 1)  # (E, I, D) or (E, D, I)
            if record.expert_noise_std:
                w_EXY += torch.randn(w_EXY.shape, generator=gen) * record.expert_noise_std
            state[f"{mlp}.{stacked}"] = w_EXY
    moe = MoETransformer(config, dense.experts_fn)
    load_state_into(moe, state)
    return moe.eval()


def upcycle(
    dense_dir: str | Path,
    out_dir: str | Path,
    num_experts: int,
    top_k: int,
    expert_noise_std: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the upcycled MoE checkpoint of the dense checkpoint `dense_dir` into `out_dir` (must not exist).

    Raises:
        CheckpointError: `dense_dir` is not a checkpoint directory, or `out_dir` exists.
        ConfigError: the dense model cannot be upcycled exactly, or an argument is out of range (key named).
    """
    src = Path(dense_dir)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a checkpoint directory")
    with staged_directory(out_dir) as tmp:
        dense_config, dense = load_checkpoint(src, dtype=torch.float32)
        config = upcycled_config(dense_config, num_experts, top_k, expert_noise_std, seed)
        write_checkpoint(config, to_hf_state_dict(upcycle_weights(dense, config)), tmp, dtype)
        copy_tokenizer(src, tmp)
    log.info("checkpoint_upcycled", source=str(src), out=str(out_dir), architecture=config.architecture.value,
             num_experts=num_experts, top_k=top_k, expert_noise_std=expert_noise_std, seed=seed)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.upcycle", description=__doc__.splitlines()[0])
    parser.add_argument("dense_dir", help="a dense (llama or qwen3) checkpoint directory, as model.convert writes")
    parser.add_argument("out_dir", help="the directory to create (must not exist)")
    parser.add_argument("--experts", type=int, required=True, help="experts per layer, E >= 1")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token, 1 <= K <= E")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="std of Gaussian noise added to every expert weight (default 0: exact copies)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the router init and the noise (default 0)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="tensor dtype written")
    args = parser.parse_args(argv)
    try:
        out = upcycle(args.dense_dir, args.out_dir, args.experts, args.top_k, args.noise, args.seed,
                      _DTYPES[args.dtype])
    except ModelError as exc:
        print(f"model.upcycle: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
