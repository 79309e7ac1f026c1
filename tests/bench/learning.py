"""Does the default run learn? Held-out pass@1 before and after a time-boxed default run, per seed.

    .venv/bin/python -m tests.bench.learning [--seeds 0 1 2] [--steps 100] [--budget-min 15] [--out DIR]

Runs ``python -m actors --steps N`` (the default run: embedded NATS, local processes, the shipped
starting policy, the built-in difficulty-1 tasks, held-out evaluation by the evaluator actor) once per
seed, one after the other, with ``run.seed`` (sampling) and ``tasks.seed`` (prompt order) set to the
seed. The evaluator measures held-out pass@1 at version 0 and at the last version N; the run ends
when that last evaluation is written, so the run's wall time (start of ``runtime.up`` to its exit)
includes the final evaluation. A seed counts as learning when the gain (last - first pass@1) is at
least 0.15 and the wall time is within the budget.

The peer here is the starting policy itself: the figure is the gain over it, on the same held-out
tasks with the same per-(task, sample) sampling seeds. Prints ONE JSON line on stdout (per seed: the
eval curve, gain, wall time, versions; overall: the median gain and how many seeds learned);
progress goes to stderr. Run on a quiet machine: the budget is wall-clock on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.metrics_log import read_run_metrics

REPO = Path(__file__).resolve().parents[2]
MIN_GAIN = 0.15


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100, help="policy versions per run (--steps of runtime.up)")
    p.add_argument("--budget-min", type=float, default=15.0, help="wall-clock budget per run, minutes")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-learning", help="run directories go here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra runtime.up overrides")
    return p.parse_args(argv)


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = asyncio.run(read_run_metrics(run_dir, kind="eval"))
    if not rows:
        raise FileNotFoundError(f"the run of {run_dir} has no eval rows")
    return sorted((int(r["version"]), float(r["pass_at_1"])) for r in rows)


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    run_dir = args.out / f"seed-{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "actors", "--quiet", "--run-dir", str(run_dir), "--steps", str(args.steps),
           "--set", f"run.seed={seed}", "--set", f"tasks.seed={seed}"]
    for override in args.set:
        cmd += ["--set", override]
    print(f"seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=args.budget_min * 60 * 3)
    wall_s = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: runtime.up exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    curve = eval_curve(run_dir)
    if not curve or curve[0][0] != 0 or curve[-1][0] != args.steps:
        raise SystemExit(f"seed {seed}: expected evaluations at versions 0 and {args.steps}, got {curve}")
    gain = curve[-1][1] - curve[0][1]
    result = {"seed": seed, "run_dir": str(run_dir), "wall_s": round(wall_s, 1), "versions": args.steps,
              "first": curve[0][1], "last": curve[-1][1], "best": max(p for _, p in curve), "gain": round(gain, 4),
              "curve": curve, "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
              "learned": gain >= MIN_GAIN and wall_s <= args.budget_min * 60}
    print(f"seed {seed}: {curve[0][1]:.3f} -> {curve[-1][1]:.3f} (gain {gain:+.3f}) in {wall_s / 60:.1f} min",
          file=sys.stderr)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run_seed(args, seed) for seed in args.seeds]
    line = {"bench": "learning", "steps": args.steps, "budget_min": args.budget_min, "min_gain": MIN_GAIN,
            "median_gain": round(statistics.median(r["gain"] for r in runs), 4),
            "seeds_learned": sum(r["learned"] for r in runs), "num_seeds": len(runs),
            "max_wall_s": max(r["wall_s"] for r in runs), "runs": runs}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
