"""Self-summarization on the long-context family: held-out pass@1 of a policy with summaries on and off.

    .venv/bin/python -m tests.bench.long_context --checkpoint DIR [--seeds 0 1 2] [--tasks 32] [--samples 2]
    .venv/bin/python -m tests.bench.long_context --merge RESULT.json [RESULT.json ...] --label LABEL
    .venv/bin/python -m tests.bench.long_context --plot RESULT.json [RESULT.json ...] --rl-run RUN_DIR [...] --out PNG

The first form evaluates the checkpoint on the first ``--tasks`` held-out long-context tasks (the same tasks for
every seed), ``--samples`` episodes a task at temperature 1, once per seed (the seed draws the sampling),
with the family's agent settings (actors.training.reference_chains.LONG_CONTEXT_AGENT: a 640-token window,
a summary asked past 560) and with the same settings without summaries (today's truncation), and prints one
JSON line: per seed and mode pass@1, summaries per episode and tokens per summary, and the means.

The second form joins results of one seed each (e.g. each RL run's final policy, evaluated with its own
seed) into one result of those seeds, under ``--label``.

The third form draws the picture: pass@1 on vs off per seed for each result (the starting policy, and the
policy after RL), and over each RL run's policy versions the training reward (the run's metrics rows;
held-out evaluations too when its evaluator wrote any) and, from its rollouts' ``rollout_finished``
events, the summaries per episode and the tokens per summary.
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

import structlog
import torch

from actors.training.evaluation import evaluate, sampled
from actors.training.reference_chains import LONG_CONTEXT_AGENT
from model.checkpoint import load_checkpoint
from runtime.metrics_log import read_run_metrics
from sandbox.long_context_tasks import generate_long_context_tasks


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="the policy to evaluate (an HF-layout directory)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", type=int, default=32, help="held-out long-context tasks")
    p.add_argument("--samples", type=int, default=2, help="episodes per task and seed")
    p.add_argument("--label", default="", help="a name for the result (the picture's legend)")
    p.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "off"], help="summaries on / off")
    p.add_argument("--merge", type=Path, nargs="+", help="result JSON files of distinct seeds to join")
    p.add_argument("--plot", type=Path, nargs="+", help="result JSON files to draw")
    p.add_argument("--rl-run", type=Path, nargs="+", default=[], help="RL run directories whose curves to draw")
    p.add_argument("--out", type=Path, help="the picture (with --plot)")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    _, model = load_checkpoint(args.checkpoint)
    tasks = generate_long_context_tasks(0, args.tasks, "heldout")
    modes = {"on": LONG_CONTEXT_AGENT, "off": dataclasses.replace(LONG_CONTEXT_AGENT, summarize_at_tokens=0)}
    modes = {mode: modes[mode] for mode in args.modes}
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
    return {"label": args.label or args.checkpoint.name, "checkpoint": str(args.checkpoint), "num_tasks": args.tasks,
            "samples_per_task": args.samples, "seeds": args.seeds, "per_seed": per_seed,
            "mean": _means(per_seed, args.seeds, list(modes))}


def _means(per_seed: dict[str, dict[str, Any]], seeds: list[int], modes: list[str]) -> dict[str, dict[str, float]]:
    return {mode: {key: round(statistics.mean(per_seed[str(seed)][mode][key] for seed in seeds), 4)
                   for key in ("pass_at_1", "mean_reward", "summaries_per_episode", "summary_tokens_per_summary")}
            for mode in modes}


def merge(results: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """Results of distinct seeds (the same tasks and modes) as one result of all their seeds."""
    seeds = [seed for r in results for seed in r["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: seeds {seeds} repeat; each result must bring its own")
    if len({(r["num_tasks"], r["samples_per_task"]) for r in results}) != 1:
        raise SystemExit("--merge: the results evaluated different numbers of tasks or samples per task")
    modes = sorted(set.intersection(*(set(r["mean"]) for r in results)))
    per_seed = {str(seed): r["per_seed"][str(seed)] for r in results for seed in r["seeds"]}
    return {"label": label, "checkpoint": [r["checkpoint"] for r in results], "num_tasks": results[0]["num_tasks"],
            "samples_per_task": results[0]["samples_per_task"], "seeds": seeds, "per_seed": per_seed,
            "mean": _means(per_seed, seeds, modes)}


def rollout_curve(run_dir: Path) -> list[dict[str, Any]]:
    """Per policy version (a rollout's newest token's): episodes, summaries per episode, tokens per summary."""
    by_version: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((run_dir / "logs").glob("rollout-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a half-written last line of a live run
                continue
            if event.get("event") == "rollout_finished":
                by_version.setdefault(int(event["max_version"]), []).append(event)
    curve = []
    for version, events in sorted(by_version.items()):
        summaries = sum(e.get("num_summaries", 0) for e in events)
        curve.append({"version": version, "episodes": len(events), "summaries_per_episode": summaries / len(events),
                      "tokens_per_summary": sum(e.get("num_summary_tokens", 0) for e in events) / max(1, summaries)})
    return curve


def plot(results: list[dict[str, Any]], rl_runs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if rl_runs else 1, figsize=(15 if rl_runs else 5, 4.5), squeeze=False)
    twin = None
    ax = axes[0][0]
    width = 0.8 / (2 * len(results))
    for i, result in enumerate(results):
        seeds = result["seeds"]
        for j, mode in enumerate(("on", "off")):
            if mode not in result["per_seed"][str(seeds[0])]:
                continue
            xs = [k + (2 * i + j) * width for k in range(len(seeds))]
            ys = [result["per_seed"][str(s)][mode]["mean_reward"] for s in seeds]
            pass_at_1 = 100 * result["mean"][mode]["pass_at_1"]
            ax.bar(xs, ys, width, label=f"{result['label']}: summaries {mode} (pass@1 {pass_at_1:.1f}%)")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(seeds))], [f"seed {s}" for s in seeds])
    ax.set(ylabel="held-out mean reward (a third per key)", title="long-context family: summaries on vs off")
    ax.set_ylim(0, 1.6 * max(ax.get_ylim()[1], 0.01))  # room for the legend above the bars
    ax.legend(fontsize=7)
    for run in rl_runs:
        rows = asyncio.run(read_run_metrics(run))
        train = sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["version"])
        evals = sorted((r for r in rows if r["kind"] == "eval"), key=lambda r: r["version"])
        line = axes[0][1].plot([r["version"] for r in train], [r["reward_mean"] for r in train], marker=".",
                               label=f"{run.name}: training reward")[0]
        axes[0][1].plot([r["version"] for r in train], [r["pass_rate"] for r in train], linestyle=":",
                        color=line.get_color(), label=f"{run.name}: training pass rate")
        if evals:
            axes[0][1].plot([r["version"] for r in evals], [r["pass_at_1"] for r in evals], marker="o",
                            color=line.get_color(), linestyle="none", label=f"{run.name}: held-out pass@1")
        curve = rollout_curve(run)
        versions = [c["version"] for c in curve]
        axes[0][2].plot(versions, [c["summaries_per_episode"] for c in curve], marker="o", color=line.get_color(),
                        label=f"{run.name}: summaries per episode")
        if twin is None:
            twin = axes[0][2].twinx()
        twin.plot(versions, [c["tokens_per_summary"] for c in curve], marker="s", linestyle="--",
                  color=line.get_color(), label=f"{run.name}: tokens per summary")
    if rl_runs:
        axes[0][1].set(xlabel="policy version", ylabel="fraction (reward: a third per key)",
                       title="RL with summaries on")
        axes[0][1].legend(fontsize=6)
        axes[0][2].set(xlabel="policy version of the rollout", ylabel="summaries per episode (o)",
                       title="summaries in RL rollouts", ylim=(0, 2.5))
        assert twin is not None
        twin.set_ylim(0, 64)
        twin.set_ylabel("tokens per summary (s, dashed)")
        axes[0][2].legend(loc="lower left", fontsize=6)
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # the events of the evaluation go to stderr: stdout is the one result line, a file of its own when kept
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.merge:
        if not args.label:
            sys.exit("--merge needs --label")
        print(json.dumps(merge([_result(p) for p in args.merge], args.label)))
        return
    if args.plot:
        if args.out is None:
            sys.exit("--plot needs --out")
        print(plot([_result(p) for p in args.plot], args.rl_run, args.out))
        return
    if args.checkpoint is None:
        sys.exit("give --checkpoint DIR (or --plot)")
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
