"""Benchmark: a real pretrained policy on real coding tasks, the `smollm2` preset, on this machine.

SmolLM2-135M-Instruct upcycled to a 4-expert MoE (actors/runs/smollm2.toml) is measured three ways:
- speed: the rollout engine's generation tokens/s (a batch of pyfunc prompts in the policy's own chat
  template, sampled as rollouts sample) and the trainer's forward+backward tokens/s on the same shapes;
- learning: a real run (``python -m actors --preset smollm2``), seconds per RL step, HumanEval pass@1 as the
  run's evaluator measures it at version 0 and at the last (greedy, with its standard error over tasks);
- the training family's held-out split (pyfunc, never trained on) before and after: the starting checkpoint
  and the run's last trainer checkpoint, evaluated here, greedy, with the run's agent settings.

``gain_in_standard_errors`` is the held-out pyfunc gain over its standard error (the two evaluations' errors
combined); the goal is at least 2 within 60 minutes. Prints ONE JSON line.

    .venv/bin/python -m tests.bench.real_model [--steps 20] [--humaneval-tasks 164] [--heldout-tasks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: this file's folder would shadow the `model` package
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.nn.functional as F

from actors.agent.dialect import load_dialect
from actors.agent.policy import checkpoint_dir
from actors.config import TasksSection
from actors.task_catalog import TaskCatalog
from actors.training.checkpoint_store import download_checkpoint, stored_checkpoints
from actors.training.evaluation import EvalResult, evaluate, greedy
from model.checkpoint import load_checkpoint
from model.engine import EngineConfig, GenerationEngine
from model.packing import pack_sequences
from model.sampling import SamplingParams
from runtime.blob import open_store
from runtime.metrics_log import read_run_metrics
from runtime.run_config import load_run_config
from runtime.rundir import RunInfo

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "actors" / "runs" / "smollm2.toml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="policy versions of the run")
    p.add_argument("--humaneval-tasks", type=int, default=164, help="HumanEval problems the run evaluates (164: all)")
    p.add_argument("--heldout-tasks", type=int, default=64, help="pyfunc held-out tasks evaluated before and after")
    p.add_argument("--batch", type=int, default=16, help="sequences in the speed measurements")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence in the speed measurement")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-real-model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides for the run")
    return p.parse_args(argv)


def speed(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, temperature: float,
          reps: int) -> dict[str, float]:
    """Median generation and training tokens/s over ``reps`` (one warm-up each)."""
    async def generate() -> float:
        engine = GenerationEngine(model, EngineConfig(max_batch_size=len(prompts)))
        await engine.start()
        try:
            start = time.perf_counter()
            gens = await asyncio.gather(*(engine.generate(p, SamplingParams(
                temperature=temperature, max_new_tokens=new_tokens, seed=i)) for i, p in enumerate(prompts)))
            return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - start)
        finally:
            await engine.stop()

    # four sequences (a few thousand tokens) a step: the logits of a 49k vocabulary over a whole batch and a 30-layer
    # backward would take more memory than the run beside it leaves
    batch = pack_sequences([torch.tensor(p) for p in prompts[:4]])

    def train() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(batch.input_ids_T, seq_lens=batch.seq_lens).logits
        F.cross_entropy(logits[batch.target_mask_T], batch.targets_T[batch.target_mask_T]).backward()
        return int(batch.input_ids_T.numel()) / (time.perf_counter() - start)

    gen = [asyncio.run(generate()) for _ in range(reps + 1)][1:]
    model.train()
    trn = [train() for _ in range(reps + 1)][1:]
    model.eval()
    return {"generation_tokens_per_s": round(statistics.median(gen), 2),
            "training_tokens_per_s": round(statistics.median(trn), 1)}


def heldout_pass(model: torch.nn.Module, tasks: list, dialect: Any, agent: Any) -> EvalResult:
    return asyncio.run(evaluate(model, tasks, sampling=greedy(), agent_config=agent, concurrency=len(tasks),
                                dialect=dialect))


async def last_checkpoint(run_dir: Path, cache: Path) -> Path:
    info = RunInfo.read(run_dir)
    async with open_store(info.storage_url, s3_endpoint=info.s3_endpoint or None) as store:
        names = await stored_checkpoints(store)
        if not names:
            raise SystemExit(f"the run of {run_dir} stored no trainer checkpoint")
        return await download_checkpoint(store, names[-1], cache)


def _stderr_pair(a: EvalResult, b: EvalResult) -> float:
    se = [r.summary()["pass_at_1_stderr"] or 0.0 for r in (a, b)]
    return math.sqrt(se[0] ** 2 + se[1] ** 2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the run's actors each get one thread: measure what a rollout actor gets
    overrides = [f"run.steps={args.steps}", f"eval.every_versions={args.steps}",
                 f"tasks.num_heldout={args.humaneval_tasks}", *args.set]
    cfg = load_run_config([REPO / "actors" / "run.toml", PRESET], overrides).app
    if args.steps % cfg.trainer.checkpoint_every:
        raise SystemExit(f"--steps {args.steps} is not a multiple of trainer.checkpoint_every = "
                         f"{cfg.trainer.checkpoint_every}: the last step would have no checkpoint to evaluate")
    start_dir = checkpoint_dir(cfg.policy)  # converted and upcycled once, cached

    # the run first, while this process holds no model: its trainer alone takes ~11 GB (weights, gradients and
    # Adam's moments of 375M parameters, and the activations), its rollout and evaluator a copy each
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    cmd = [sys.executable, "-m", "actors", "--preset", "smollm2", "--quiet", "--run-dir", str(run_dir)]
    for override in overrides:
        cmd += ["--set", override]
    print(" ".join(cmd[1:]), file=sys.stderr)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_s = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"the run exited {proc.returncode}:\n{proc.stderr[-3000:]}")

    dialect = load_dialect(start_dir)
    _, model = load_checkpoint(start_dir)
    model.eval()
    pyfunc = TaskCatalog.build(TasksSection(family="pyfunc", difficulties=cfg.tasks.difficulties,
                                            num_heldout=args.heldout_tasks, seed=cfg.tasks.seed))
    prompts = [dialect.prompt_ids(t.prompt) for t in pyfunc.train[:args.batch]]
    figures = speed(model, prompts, args.new_tokens, cfg.rollout.temperature, args.reps)
    print(f"speed: {figures}", file=sys.stderr)
    agent = cfg.rollout.agent
    before = heldout_pass(model, list(pyfunc.heldout), dialect, agent)
    print(f"pyfunc held-out before: {before.pass_at_1:.3f}", file=sys.stderr)
    del model
    evals = sorted(asyncio.run(read_run_metrics(run_dir, kind="eval")), key=lambda r: r["version"])
    trains = asyncio.run(read_run_metrics(run_dir, kind="train"))
    with tempfile.TemporaryDirectory() as tmp:
        _, trained = load_checkpoint(asyncio.run(last_checkpoint(run_dir, Path(tmp))))
    after = heldout_pass(trained.eval(), list(pyfunc.heldout), dialect, agent)
    gain = after.pass_at_1 - before.pass_at_1
    se = _stderr_pair(before, after)
    line = {
        "bench": "real_model", "policy": "smollm2-135m-instruct upcycled 4x top-2", "steps": args.steps,
        **figures, "seconds_per_rl_step": round(run_s / max(1, len(trains)), 1), "run_s": round(run_s, 1),
        "num_trained_steps": len(trains),
        "humaneval_tasks": args.humaneval_tasks,
        "humaneval_pass_at_1_before": evals[0]["pass_at_1"] if evals else None,
        "humaneval_pass_at_1_before_stderr": evals[0].get("pass_at_1_stderr") if evals else None,
        "humaneval_pass_at_1_after": evals[-1]["pass_at_1"] if len(evals) > 1 else None,
        "humaneval_pass_at_1_after_stderr": evals[-1].get("pass_at_1_stderr") if len(evals) > 1 else None,
        "humaneval_versions": [r["version"] for r in evals],
        "heldout_family": "pyfunc", "heldout_tasks": len(pyfunc.heldout),
        "heldout_pass_at_1_before": round(before.pass_at_1, 4), "heldout_pass_at_1_after": round(after.pass_at_1, 4),
        "heldout_gain": round(gain, 4), "heldout_gain_stderr": round(se, 4),
        "gain_in_standard_errors": round(gain / se, 2) if se > 0 else None,
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "run_dir": str(run_dir), "command": " ".join(["python -m tests.bench.real_model", *(argv or sys.argv[1:])]),
    }
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
