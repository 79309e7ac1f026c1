"""Asynchrony where environments are slow: synchronous (eta = 0) vs asynchronous (eta = 1, 2, 4) real runs
whose tool calls and tests answer with heavy-tailed latencies.

    .venv/bin/python -m tests.bench.latency_tail [--trials 3] [--steps 8] [--etas 1 2 4]
        [--tool-median-s 1] [--test-median-s 1] [--sigma 1.5] [--latency-seed 0]

Each mode is one ``python -m runtime.up`` of the default run's actors (reconciler, rollout with sandboxed
tool calls, reward with hidden tests, grouping, trainer; the evaluator off, as in tests.bench.e2e), from the
same policy, on the same prompts in the same order, for the same number of trainer steps (so the same number
of trained samples), with the run's own environment latency switched on (``tasks.latency``: a lognormal
delay before each tool call's result and each grading's outcome, drawn from the seed and the sample, so
every mode meets the same delay at the same call of the same sample). The modes differ only in
``reconciler.scheduling.eta`` (every mode with ``cut_stragglers`` on: the trainer is not held for a due
group's slowest episode once a batch of others is ready; a synchronous run never has one). Default heavy tail:
median 1 s for a tool call and for a grading, sigma 1.5 (p99 = 33x the median), each delay capped at 120 s.

Rollouts in flight are bounded by each mode's admission alone (``--inflight 0``: slots = (eta + 1) * B * G),
since waiting environments take no engine, trainer or CPU: a synchronous run cannot use more than one batch
of them, an asynchronous one can. ``--inflight N`` caps both modes at N instead (equal environments).

Figures per mode (medians over ``--trials``, the trials alternating the order of the modes):
- ``samples_per_s``: trained samples over the wall time from the first rollout's start (actor start-up
  excluded, the pipeline's fill included) to the last step's metrics row; ``ratio_vs_sync`` its ratio to
  the synchronous mode's. ``steady`` and ``from_start`` are tests.bench.e2e's windows.
- ``trainer_busy_share``: the steps' learner time (``step_s``) over that window; ``trainer_utilisation``:
  the trainer's own figure in its last row (its step, checkpoint and weight upload time over its uptime).
- staleness: ``lag_max`` (trainer version - oldest token version, at training) and ``lag_within_eta``.
- what the bound cost: ``num_stragglers_cut`` (samples of a due group failed rather than waited on, so a step
  may train fewer than B * G samples: ``num_samples`` counts those trained) and ``num_groups_dropped``.
- the learning curve: training reward and pass rate per step; ``learning.reward_last_half``: the mean
  training reward of the last half of the steps (the same steps in every mode), with its standard error.
- ``env_delay``: the tool and grading delays the run's samples met (median and p99 of each wait).

``checks`` says whether the issue's bar holds: eta = 4 at >= 3x synchronous samples/s, every lag within
its eta, and the asynchronous learning result no worse than the synchronous one beyond two standard
errors. The machine's load before and after each run is reported: a shared machine's figures are not quiet.
Prints ONE JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from actors.config import LatencySection
from tests.bench import e2e

REPO = e2e.REPO

# Layered over the e2e bench's run file (its policy, tasks, reconciler and agent settings at this mode's eta).
LATENCY_FILE = """\
[run]
name = "bench-latency-tail-{mode}"
[actors.reward]
max_concurrency = {reward_concurrency}  # gradings wait on the environment, not on a stage cap
[reconciler.scheduling]
cut_stragglers = true  # the environment, not faults, sets the pace here (a synchronous run never cuts)
[tasks.latency]
distribution = "lognormal"
tool_median_s = {tool_median_s}
test_median_s = {test_median_s}
sigma = {sigma}
max_s = {max_s}
seed = {latency_seed}
"""

DEFAULT = LatencySection(distribution="lognormal")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3, help="runs per mode; figures are medians")
    p.add_argument("--steps", type=int, default=8, help="trainer steps per run (>= 2), every mode")
    p.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4], help="the asynchronous modes' bounds")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=2)
    p.add_argument("--inflight", type=int, default=0,
                   help="rollouts in flight per mode; 0: what its admission allows, (eta + 1) * B * G")
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tool-median-s", type=float, default=DEFAULT.tool_median_s)
    p.add_argument("--test-median-s", type=float, default=DEFAULT.test_median_s)
    p.add_argument("--sigma", type=float, default=DEFAULT.sigma, help="lognormal shape: p99/median = exp(2.326 sigma)")
    p.add_argument("--max-s", type=float, default=DEFAULT.max_s)
    p.add_argument("--latency-seed", type=int, default=DEFAULT.seed)
    p.add_argument("--seed", type=int, default=0, help="run seed and task order, every mode")
    p.add_argument("--policy", choices=("auto", "starting", "random"), default="auto",
                   help="as tests.bench.e2e: the cached starting policy if present (auto), else random")
    p.add_argument("--checkpoint", type=Path, help="this HF-layout checkpoint directory (overrides --policy)")
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="per run, from start to the last step")
    p.add_argument("--keep", type=Path, help="keep the run directories under this directory")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps={args.steps}: the windows need at least 2 steps")
    if args.trials < 1 or not args.etas or min(args.etas) < 1:
        p.error(f"--trials={args.trials} must be >= 1 and --etas={args.etas} positive (eta = 0 is the baseline)")
    LatencySection("lognormal", args.tool_median_s, args.test_median_s, args.sigma, args.max_s, args.latency_seed)
    return args


# --- one run ---------------------------------------------------------------------------------------
def run_mode(args: argparse.Namespace, name: str, eta: int, checkpoint: Path, work_dir: Path) -> dict[str, Any]:
    """Starts runtime.up at this eta with the latency on, waits for the last train row, stops the run."""
    batch = args.group_size * args.batch_groups
    slots = (eta + 1) * batch
    mode = name.split("-")[0]
    run_file = e2e.RUN_FILE.format(
        mode=mode, seed=args.seed, steps=args.steps, checkpoint=checkpoint, num_slots=slots,
        group_size=args.group_size, batch_groups=args.batch_groups, eta=eta, inflight=args.inflight or slots,
        max_turns=args.max_turns, max_new_tokens=args.max_new_tokens)
    latency = LATENCY_FILE.format(
        mode=mode, reward_concurrency=(max(args.etas) + 1) * batch, tool_median_s=args.tool_median_s,
        test_median_s=args.test_median_s, sigma=args.sigma, max_s=args.max_s, latency_seed=args.latency_seed)
    load_before = os.getloadavg()[0]
    print(f"{name}: eta={eta}", file=sys.stderr, flush=True)
    run_dir, rows, exit_code = e2e.run_to_steps(name, [run_file, latency], args.steps, args.run_timeout_s, work_dir)
    started_at = json.loads((run_dir / "run.json").read_text())["started_at"]
    events = run_events(run_dir)
    first_rollout = min(t - d for t, d, _ in events["rollout"]) if events["rollout"] else started_at
    window = rows[-1]["time"] - first_rollout
    figures = e2e.summarise(rows, started_at)
    num_samples = figures["num_samples"]
    return {
        "eta": eta,
        "inflight": args.inflight or slots,
        "samples_per_s": round(num_samples / window, 4),
        "window_s": round(window, 2),
        "trainer_busy_share": round(sum(r["step_s"] for r in rows) / window, 4),
        "trainer_utilisation": round(rows[-1]["trainer_utilisation"], 4),
        **figures,
        "lag_within_eta": figures["lag_max"] <= eta,
        "learning_curve": {"reward_mean": [round(r["reward_mean"], 4) for r in rows],
                           "pass_rate": [round(r["pass_rate"], 4) for r in rows]},
        "reward_last_half": last_half(rows),
        "num_stragglers_cut": len(set(events["stragglers_cut"])),
        "num_groups_dropped": len(set(events["groups_dropped"])),
        "env_delay": {"tool_per_episode": quantiles([d for _, _, d in events["rollout"]]),
                      "test": quantiles(events["test"]),
                      "num_rollouts_finished": len(events["rollout"])},
        "exit_code": exit_code,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def run_events(run_dir: Path) -> dict[str, list]:
    """From the run's event logs: each finished rollout's (end time, duration, tool delay), each grading's delay,
    the samples the reconciler cut as stragglers and the groups it dropped."""
    rollouts, tests, cut, dropped = [], [], [], []
    for path in (run_dir / "logs").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if '"rollout_finished"' in line:
                e = json.loads(line)
                end = datetime.fromisoformat(e["time"]).timestamp()
                rollouts.append((end, e["duration_s"], e.get("env_delay_s", 0.0)))
            elif '"sample_rewarded"' in line:
                tests.append(json.loads(line).get("env_delay_s", 0.0))
            elif '"stragglers_cut"' in line:
                cut += json.loads(line)["sample_ids"]
            elif '"group_dropped"' in line:
                dropped.append(json.loads(line)["group_id"])
    return {"rollout": rollouts, "test": tests, "stragglers_cut": cut, "groups_dropped": dropped}


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median_s": None, "p99_s": None, "max_s": None}
    ordered = sorted(values)
    return {"median_s": round(statistics.median(ordered), 3),
            "p99_s": round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 3),
            "max_s": round(ordered[-1], 3)}


def last_half(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean training reward of the last half of the steps, and its standard error over those steps."""
    rewards = [r["reward_mean"] for r in rows[len(rows) // 2:]]
    se = statistics.stdev(rewards) / math.sqrt(len(rewards)) if len(rewards) > 1 else 0.0
    return {"mean": round(statistics.fmean(rewards), 4), "se": round(se, 4)}


# --- the modes side by side ------------------------------------------------------------------------
def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its trials: median figures, pooled lag, the median learning curve, and each run."""
    med = lambda f: round(statistics.median(f(r) for r in runs), 4)  # noqa: E731
    steps = len(runs[0]["learning_curve"]["reward_mean"])
    return {
        "eta": runs[0]["eta"],
        "inflight": runs[0]["inflight"],
        "num_trials": len(runs),
        "num_samples": runs[0]["num_samples"],
        "samples_per_s": med(lambda r: r["samples_per_s"]),
        "window_s": med(lambda r: r["window_s"]),
        "trainer_busy_share": med(lambda r: r["trainer_busy_share"]),
        "trainer_utilisation": med(lambda r: r["trainer_utilisation"]),
        "steady_samples_per_s": med(lambda r: r["steady"]["samples_per_s"]),
        "from_start_samples_per_s": med(lambda r: r["from_start"]["samples_per_s"]),
        "step_s_median": med(lambda r: r["step_s_median"]),
        "lag_max": max(r["lag_max"] for r in runs),
        "lag_mean": med(lambda r: r["lag_mean"]),
        "lag_within_eta": all(r["lag_within_eta"] for r in runs),
        "num_stragglers_cut": [r["num_stragglers_cut"] for r in runs],
        "num_groups_dropped": [r["num_groups_dropped"] for r in runs],
        "learning_curve": {key: [round(statistics.median(r["learning_curve"][key][i] for r in runs), 4)
                                 for i in range(steps)] for key in ("reward_mean", "pass_rate")},
        "reward_last_half": {"mean": med(lambda r: r["reward_last_half"]["mean"]),
                             "se": med(lambda r: r["reward_last_half"]["se"])},
        "runs": [{k: v for k, v in r.items() if k not in ("lag_tokens", "lag_min_max_per_step")} for r in runs],
    }


def checks(sync: dict[str, Any], modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's bar: eta = 4 at >= 3x, lags within eta, learning no worse than synchronous (2 SE)."""
    out: dict[str, Any] = {"staleness_within_eta": sync["lag_within_eta"]
                           and all(m["lag_within_eta"] for m in modes.values())}
    if "eta=4" in modes:
        out["eta=4_at_least_3x"] = modes["eta=4"]["ratio_vs_sync"] >= 3.0
    base = sync["reward_last_half"]
    for name, m in modes.items():
        mine = m["reward_last_half"]
        tolerance = 2 * math.hypot(base["se"], mine["se"])
        out[f"{name}_learning_no_worse"] = mine["mean"] >= base["mean"] - tolerance
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    modes = [("sync", 0), *((f"eta={eta}", eta) for eta in args.etas)]
    with tempfile.TemporaryDirectory(prefix="bench-latency-tail-") as tmp:
        work_dir = args.keep.resolve() if args.keep else Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        kind, checkpoint = e2e.choose_policy(args, work_dir)
        print(f"policy: {kind} {checkpoint}", file=sys.stderr, flush=True)
        started = time.monotonic()
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in modes}
        for trial in range(args.trials):
            for name, eta in modes if trial % 2 == 0 else modes[::-1]:
                label = "sync" if eta == 0 else f"eta{eta}"
                runs[name].append(run_mode(args, f"{label}-{trial}", eta, checkpoint, work_dir))
    sync = median_of(runs["sync"])
    asynchronous = {}
    for name, _ in modes[1:]:
        m = median_of(runs[name])
        m["ratio_vs_sync"] = round(m["samples_per_s"] / sync["samples_per_s"], 3)
        m["ratio_per_trial"] = [round(a["samples_per_s"] / s["samples_per_s"], 3)
                                for a, s in zip(runs[name], runs["sync"], strict=True)]
        asynchronous[name] = m
    latency = LatencySection("lognormal", args.tool_median_s, args.test_median_s, args.sigma, args.max_s,
                             args.latency_seed)
    return {
        "bench": "latency_tail",
        "policy": {"kind": kind, "checkpoint": str(checkpoint)},
        "config": {"steps": args.steps, "group_size": args.group_size, "batch_groups": args.batch_groups,
                   "trained_samples_per_run": args.steps * args.group_size * args.batch_groups,
                   "inflight": args.inflight or "(eta + 1) * B * G", "max_turns": args.max_turns,
                   "max_new_tokens": args.max_new_tokens, "seed": args.seed, "trials": args.trials,
                   "evaluator": False},
        "latency": {"key": "tasks.latency", "distribution": "lognormal", "tool_median_s": args.tool_median_s,
                    "test_median_s": args.test_median_s, "sigma": args.sigma, "max_s": args.max_s,
                    "seed": args.latency_seed,
                    "p99_over_median": round(latency.tool().quantile(0.99) / latency.tool().quantile(0.5), 2)},
        "sync": sync,
        "async": asynchronous,
        "checks": checks(sync, asynchronous),
        "bench_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: one JSON line
    print(json.dumps(main()))
