"""Benchmark: our MoE transformer vs HF transformers Qwen3MoeForCausalLM at its defaults, same config and weights.

The peer is what a user gets from ``Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)``:
transformers picks SDPA attention and its ``grouped_mm`` experts (``torch.nn.functional.grouped_mm``,
which has a CPU kernel in the installed torch), also its fastest on CPU here (two probes, tiny config,
training, loads 8 and 25: eager attention and experts at 0.76x and 0.59x the defaults' tokens/s,
``batched_mm`` experts at 0.12x).
The line names the implementations transformers actually resolved; ``--peer-attn`` / ``--peer-experts``
choose others (``eager`` reproduces the previous figures). Before timing, a parity check on the same
weights and inputs: the largest logit difference and the training losses of both, refused past
``PARITY_TOLERANCE`` (they would not be computing the same model).

Measures, for the tiny default and the ~100M configuration, in fp32 on CPU:
- training tokens/s: forward + backward of next-token cross-entropy over a batch of equal-length
  sequences (ours packed, HF as a (B, L) batch with labels);
- generation tokens/s: B prompts, greedy, fixed number of new tokens (ours: the async `GenerationEngine`
  with continuous batching and KV cache; HF: `generate` with its KV cache).
Runs alternate between the two implementations; medians are reported, with the 1-minute load average
before and after (the machine may be shared). Both run at the process's intra-op thread count
(``threads``) except the engine's step thread, which takes ``EngineConfig.intra_op_threads`` (by default
chosen by the model's size, ``model.step_thread.auto_threads``: one for tiny, the process's for 100M;
``--engine-threads`` overrides it; ``<config>_engine_threads`` records what ran).
Under load the peer's two-thread OpenMP regions stall on preempted
threads far more than the engine's single thread (transformers fell to 46 tok/s at load 7 where the
engine kept 2.9k): read ratios only from runs with a low load average. Prints ONE JSON line.

    .venv/bin/python tests/bench/model.py [--quick | --config medium_100m]      (or: python -m tests.bench.model)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

if not __package__:  # run as a script: this file's folder would shadow the `model` package
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.nn.functional as F

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import ModelConfig, medium_100m, tiny
from model.engine import EngineConfig, GenerationEngine, SamplingParams
from model.packing import pack_sequences
from model.step_thread import auto_threads
from model.transformer import MoETransformer

EngineThreads = int | Literal["auto"] | None

PARITY_TOLERANCE = 1e-3  # fp32, same weights and inputs: max |logit difference| and |loss difference|

SHAPES = {
    # name: (config, train batch, train len, gen batch, prompt len, new tokens)
    "tiny": (tiny, 8, 256, 16, 32, 64),
    "medium_100m": (medium_100m, 4, 256, 8, 32, 32),
}


def _median_pair(ours: Callable[[], float], theirs: Callable[[], float], reps: int) -> tuple[float, float]:
    ours(), theirs()  # warm up
    a, b = [], []
    for _ in range(reps):
        a.append(ours())
        b.append(theirs())
    return statistics.median(a), statistics.median(b)


def _train_fns(ours: MoETransformer, hf: torch.nn.Module, ids_BL: torch.Tensor):
    batch = pack_sequences(list(ids_BL))
    n_tokens = ids_BL.numel()

    def run_ours() -> float:
        ours.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = ours(batch.input_ids_T, seq_lens=batch.seq_lens).logits
        loss = F.cross_entropy(logits[batch.target_mask_T], batch.targets_T[batch.target_mask_T])
        loss.backward()
        return n_tokens / (time.perf_counter() - start)

    def run_hf() -> float:
        hf.zero_grad(set_to_none=True)
        start = time.perf_counter()
        hf(ids_BL, labels=ids_BL).loss.backward()
        return n_tokens / (time.perf_counter() - start)

    return run_ours, run_hf


def parity(ours: MoETransformer, hf: torch.nn.Module, ids_BL: torch.Tensor) -> dict[str, float]:
    """Same weights, same tokens: the largest logit difference and both training losses (no grad)."""
    batch = pack_sequences(list(ids_BL))
    with torch.no_grad():
        logits_BLV = ours(batch.input_ids_T, seq_lens=batch.seq_lens).logits.view(*ids_BL.shape, -1)
        ours_loss = F.cross_entropy(logits_BLV[:, :-1].flatten(0, 1), ids_BL[:, 1:].flatten()).item()
        hf_out = hf(ids_BL, labels=ids_BL)
    result = {
        "parity_max_abs_logit_diff": (logits_BLV - hf_out.logits).abs().max().item(),
        "parity_loss": ours_loss,
        "parity_hf_loss": hf_out.loss.item(),
    }
    if max(result["parity_max_abs_logit_diff"], abs(ours_loss - result["parity_hf_loss"])) > PARITY_TOLERANCE:
        raise AssertionError(f"ours and transformers compute different models: {result}")
    return result


def _gen_fns(ours: MoETransformer, hf: torch.nn.Module, prompts_BP: torch.Tensor, new: int, threads: EngineThreads):
    b = prompts_BP.shape[0]
    params = SamplingParams(max_new_tokens=new, temperature=0.0)

    async def ours_async() -> float:
        engine = GenerationEngine(ours, EngineConfig(max_batch_size=b, intra_op_threads=threads))
        await engine.start()
        try:
            start = time.perf_counter()
            gens = await asyncio.gather(*(engine.generate(p.tolist(), params) for p in prompts_BP))
            elapsed = time.perf_counter() - start
        finally:
            await engine.stop()
        assert all(len(g.token_ids) == new for g in gens)
        return b * new / elapsed

    def run_hf() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(prompts_BP, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert out.shape[1] == prompts_BP.shape[1] + new
        return b * new / (time.perf_counter() - start)

    return lambda: asyncio.run(ours_async()), run_hf


def load_peer(checkpoint_dir: str, attn: str | None, experts: str | None) -> torch.nn.Module:
    """transformers' Qwen3-MoE from our checkpoint; None keeps transformers' default implementation."""
    import transformers

    chosen = {k: v for k, v in {"attn_implementation": attn, "experts_implementation": experts}.items() if v}
    return transformers.Qwen3MoeForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32, **chosen)


def peer_implementations(hf: torch.nn.Module) -> dict[str, str]:
    """What transformers resolved (its defaults fall back to eager where a kernel cannot run)."""
    return {"attn": hf.config._attn_implementation, "experts": hf.config._experts_implementation}


def bench_config(
    name: str, reps: int, attn: str | None, experts: str | None, threads: EngineThreads = "auto"
) -> dict[str, float | str]:
    make, tb, tl, gb, pl, new = SHAPES[name]
    config: ModelConfig = make()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(MoETransformer(config).init_weights(0), tmp)
        _, ours = load_checkpoint(tmp)
        hf = load_peer(tmp, attn, experts)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (tb, tl), generator=gen)
    ours.eval(), hf.eval()
    checked = parity(ours, hf, ids)
    ours.train(), hf.train()
    train_ours, train_hf = _median_pair(*_train_fns(ours, hf, ids), reps)
    ours.eval(), hf.eval()
    prompts = torch.randint(0, 256, (gb, pl), generator=gen)
    gen_ours, gen_hf = _median_pair(*_gen_fns(ours, hf, prompts, new, threads), reps)
    resolved = auto_threads(ours) if threads == "auto" else threads
    implementations = peer_implementations(hf)
    return {
        "params": config.num_parameters(),
        "peer_attn": implementations["attn"],
        "peer_experts": implementations["experts"],
        **{k: round(v, 6) for k, v in checked.items()},
        "train_tokens": tb * tl,
        "train_tok_s": round(train_ours, 1),
        "hf_train_tok_s": round(train_hf, 1),
        "train_ratio": round(train_ours / train_hf, 3),
        "engine_threads": torch.get_num_threads() if resolved is None else resolved,
        "gen_batch": gb,
        "gen_new_tokens": new,
        "gen_tok_s": round(gen_ours, 1),
        "hf_gen_tok_s": round(gen_hf, 1),
        "gen_ratio": round(gen_ours / gen_hf, 3),
    }


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny config only, 2 repetitions")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--config", action="append", choices=list(SHAPES), help="configurations to run (repeatable; default all)"
    )
    parser.add_argument("--peer-attn", help="transformers attn_implementation (default: transformers' own, sdpa)")
    parser.add_argument(
        "--peer-experts", help="transformers experts_implementation (default: transformers' own, grouped_mm)"
    )
    parser.add_argument(
        "--engine-threads", default="auto", help="the engine step thread's intra-op threads: auto (default) or N"
    )
    args = parser.parse_args()
    threads: EngineThreads = "auto" if args.engine_threads == "auto" else int(args.engine_threads)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    names = ["tiny"] if args.quick else args.config or list(SHAPES)
    reps = 2 if args.quick else args.reps
    load_start = os.getloadavg()[0]
    results = {name: bench_config(name, reps, args.peer_attn, args.peer_experts, threads) for name in names}
    peers = {f"{r['peer_attn']} attention, {r['peer_experts']} experts" for r in results.values()}
    print(
        json.dumps(
            {
                "bench": "model",
                "dtype": "float32",
                "device": "cpu",
                "threads": torch.get_num_threads(),
                # the engine's step thread (model.step_thread says why); <config>_engine_threads: what ran
                "engine_intra_op_threads": threads,
                "peer": f"transformers {transformers_version()} Qwen3MoeForCausalLM, " + "; ".join(sorted(peers)),
                "load_avg_1m_start": round(load_start, 2),
                "load_avg_1m_end": round(os.getloadavg()[0], 2),
                **{f"{n}_{k}": v for n, r in results.items() for k, v in r.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
