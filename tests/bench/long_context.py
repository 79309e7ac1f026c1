"""Self-summarization on the long-context family: held-out pass@1 of a policy with summaries on and off.

    .venv/bin/python -m tests.bench.long_context --checkpoint DIR [--seeds 0 1 2] [--tasks 32] [--samples 2]
    .venv/bin/python -m tests.bench.long_context --plot RESULT.json [RESULT.json ...] --rl-run RUN_DIR --out PNG

The first form evaluates the checkpoint on the first ``--tasks`` held-out long-context tasks (the same tasks for
every seed), ``--samples`` episodes a task at temperature 1, once per seed (the seed draws the sampling),
with the family's agent settings (actors.training.reference_chains.LONG_CONTEXT_AGENT: a 640-token window,
a summary asked past 560) and with the same settings without summaries (today's truncation), and prints one
JSON line: per seed and mode pass@1, summaries per episode and tokens per summary, and the means.

The second form draws the picture: pass@1 on vs off per seed for each result (the starting policy, and the
policy after RL), and the RL run's held-out evaluations over its versions (pass@1, summaries per episode,
summary length) from its metrics.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from actors.training.evaluation import evaluate, sampled
from actors.training.reference_chains import LONG_CONTEXT_AGENT
from model.checkpoint import load_checkpoint
from runtime.metrics_log import read_metrics
from sandbox.long_context_tasks import generate_long_context_tasks


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="the policy to evaluate (an HF-layout directory)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", type=int, default=32, help="held-out long-context tasks")
    p.add_argument("--samples", type=int, default=2, help="episodes per task and seed")
    p.add_argument("--label", default="", help="a name for the result (the picture's legend)")
    p.add_argument("--plot", type=Path, nargs="+", help="result JSON files to draw")
    p.add_argument("--rl-run", type=Path, help="the RL run directory whose evaluations to draw")
    p.add_argument("--out", type=Path, help="the picture (with --plot)")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    _, model = load_checkpoint(args.checkpoint)
    tasks = generate_long_context_tasks(0, args.tasks, "heldout")
    modes = {"on": LONG_CONTEXT_AGENT, "off": dataclasses.replace(LONG_CONTEXT_AGENT, summarize_at_tokens=0)}
    per_seed: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        for mode, agent in modes.items():
            started = time.monotonic()
            result = asyncio.run(evaluate(model, tasks, sampling=sampled(1.0, 1.0, seed=seed), agent_config=agent,
                                          samples_per_task=args.samples))
            s = result.summary()
            ends: dict[str, int] = {}
            for e in result.episodes:
                ends[e.end.value] = ends.get(e.end.value, 0) + 1
            per_seed.setdefault(str(seed), {})[mode] = {
                "pass_at_1": s["pass_at_1"], "mean_reward": s["mean_reward"],
                "summaries_per_episode": s["summaries_per_episode"],
                "summary_tokens_per_summary": s["summary_tokens_per_summary"], "ends": ends,
                "seconds": round(time.monotonic() - started, 1)}
            print(f"seed {seed} {mode}: {per_seed[str(seed)][mode]}", file=sys.stderr)
    means = {mode: {key: round(statistics.mean(per_seed[str(seed)][mode][key] for seed in args.seeds), 4)
                    for key in ("pass_at_1", "summaries_per_episode", "summary_tokens_per_summary")}
             for mode in modes}
    return {"label": args.label or args.checkpoint.name, "checkpoint": str(args.checkpoint), "num_tasks": args.tasks,
            "samples_per_task": args.samples, "seeds": args.seeds, "per_seed": per_seed, "mean": means}


def plot(results: list[dict[str, Any]], rl_run: Path | None, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if rl_run else 1, figsize=(14 if rl_run else 5, 4), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / (2 * len(results))
    for i, result in enumerate(results):
        seeds = result["seeds"]
        for j, mode in enumerate(("on", "off")):
            xs = [k + (2 * i + j) * width for k in range(len(seeds))]
            ys = [100 * result["per_seed"][str(s)][mode]["pass_at_1"] for s in seeds]
            ax.bar(xs, ys, width, label=f"{result['label']}: summaries {mode}")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(seeds))], [f"seed {s}" for s in seeds])
    ax.set(ylabel="held-out pass@1 (%)", title="long-context family: summaries on vs off")
    ax.legend(fontsize=7)
    if rl_run:
        evals = sorted((r for r in read_metrics(rl_run / "metrics.jsonl", kind="eval", missing_ok=False)),
                       key=lambda r: r["version"])
        versions = [r["version"] for r in evals]
        axes[0][1].plot(versions, [100 * r["pass_at_1"] for r in evals], marker="o")
        axes[0][1].set(xlabel="policy version", ylabel="held-out pass@1 (%)", title="RL with summaries on")
        axes[0][2].plot(versions, [r.get("summaries_per_episode", 0) for r in evals], marker="o",
                        label="summaries per episode")
        twin = axes[0][2].twinx()
        twin.plot(versions, [r.get("summary_tokens_per_summary", 0) for r in evals], marker="s", color="tab:orange",
                  label="tokens per summary")
        axes[0][2].set(xlabel="policy version", ylabel="summaries per episode", title="summaries during RL")
        twin.set_ylabel("tokens per summary")
        axes[0][2].legend(loc="upper left", fontsize=7)
        twin.legend(loc="upper right", fontsize=7)
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        if args.out is None:
            sys.exit("--plot needs --out")
        print(plot([json.loads(p.read_text()) for p in args.plot], args.rl_run, args.out))
        return
    if args.checkpoint is None:
        sys.exit("give --checkpoint DIR (or --plot)")
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
