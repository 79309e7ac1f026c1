"""End-to-end RL throughput, asynchronous (eta = 2) vs synchronous (eta = 0), on the real system.

    .venv/bin/python -m tests.bench.e2e [--steps 8] [--group-size 4] [--batch-groups 2] [--repeats 1]
                                        [--checkpoint DIR | --policy auto|starting|random]

Runs ``python -m runtime.up`` twice in one invocation, one mode after the other: the default run's
actors (reconciler, rollout, reward with sandboxed hidden tests, grouping, trainer), the default task
set, the same seed, the same policy checkpoint, the same step budget, the same rollout capacity. The
only difference is ``reconciler.scheduling.eta``: with eta = 0 the admission bound admits one batch of
groups and admits nothing more until that batch is trained, so generation and training alternate
(the synchronous baseline); with eta = 2 generation runs ahead of the trainer by up to two versions.

The evaluator actor is switched off (``count = 0``) in the bench's run file, layered on the default
run's, so no held-out evaluation takes CPU from the measured stages; since it is the actor that
finishes a run with a step budget, the bench itself stops each run (SIGTERM to runtime.up: every
actor drains) once the trainer's metrics show the last step.

Figures per mode, from the trainer's rows in the run's metrics (its blob store):
- ``steady``: steps 2..N over the wall time from the first to the last train row (start-up and the
  first batch's pipeline fill excluded): trained samples/s, and trainer utilisation = sum of the
  steps' ``step_s`` (the learner's forward/backward/optimizer time) over that wall time.
- ``from_start``: every step over the wall time from the run's start (run.json, the bus is up and the
  actors start) to the last train row; includes actor start-up and model loading, equal in both modes.
- the lag distribution (trained tokens per lag = trainer version - token version), lag min/max per
  batch, and the number of policy versions per batch.
The ratios are async / sync of samples/s and of utilisation. With ``--repeats R`` the bench runs R
pairs, alternating which mode goes first, and reports per-mode medians (each run is in ``runs``).
The policy is the cached starting policy when one exists (``--policy auto``), else a randomly
initialised tiny policy; the line says which.
The machine's 1-minute load average before and after each run is reported: on a shared machine the
two runs may see different loads. Prints ONE JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from actors.__main__ import DEFAULT_RUN_FILE
from runtime.metrics_log import read_run_metrics

REPO = Path(__file__).resolve().parents[2]

# Layered on the default run (actors/run.toml: its actors), as `python -m actors --config A --config B` does.
RUN_FILE = """\
[run]
name = "bench-e2e-{mode}"
seed = {seed}
steps = {steps}

[actors.evaluator]
count = 0  # no held-out evaluation taking CPU from the measured stages

[policy]
checkpoint = "{checkpoint}"
[tasks]
seed = {seed}
[reconciler]
num_slots = {num_slots}
group_size = {group_size}
batch_size_groups = {batch_groups}
[reconciler.scheduling]
eta = {eta}
max_inflight_per_rollout_actor = {inflight}
[rollout.agent]
max_turns = {max_turns}
max_new_tokens_per_turn = {max_new_tokens}
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="trainer steps per mode (>= 2)")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--batch-groups", type=int, default=2, help="groups per training batch (B)")
    p.add_argument("--eta", type=int, default=2, help="staleness bound of the asynchronous mode")
    p.add_argument(
        "--inflight",
        type=int,
        default=8,
        help="rollouts in flight per rollout actor, both modes (default: one batch, G*B)",
    )
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="generated tokens per turn at most (a whole write_file call of a difficulty-1 solution "
                        "takes ~100 bytes; with 96 every call was cut short, malformed, and no batch had a signal)")
    p.add_argument("--seed", type=int, default=0, help="run seed and task order, both modes")
    p.add_argument(
        "--policy",
        choices=("auto", "starting", "random"),
        default="auto",
        help="auto: the cached starting policy if present, else random; starting: build it if "
        "needed (minutes); random: a randomly initialised tiny policy",
    )
    p.add_argument("--checkpoint", type=Path, help="use this HF-layout checkpoint directory (overrides --policy)")
    p.add_argument("--order", default="async,sync", help="which mode runs first: async,sync or sync,async")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="pairs of runs; the order alternates from pair to pair and the figures are medians",
    )
    p.add_argument("--run-timeout-s", type=float, default=420.0, help="per mode, from start to the last step")
    p.add_argument("--keep", type=Path, help="keep the run directories under this directory")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps={args.steps}: the steady window needs at least 2 steps")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    if sorted(args.order.split(",")) != ["async", "sync"]:
        p.error(f"--order={args.order!r}: use async,sync or sync,async")
    return args


# --- the policy ------------------------------------------------------------------------------------
def cached_starting_policy(cache_dir: Path) -> Path | None:
    """The starting policy of the current recipe if it is cached or shipped; never builds it."""
    from actors.training.starting_policy import SHIPPED_DIR, StartingPolicyCard, default_recipe

    recipe_hash = default_recipe().recipe_hash()
    for directory in (cache_dir / f"starting-policy-{recipe_hash[:16]}", SHIPPED_DIR):
        try:
            card = StartingPolicyCard.read(directory)
        except (OSError, ValueError, TypeError):
            continue
        if card.recipe_hash == recipe_hash and (directory / "model.safetensors").is_file():
            return directory
    return None


def random_policy(directory: Path, seed: int) -> Path:
    import torch

    from model.checkpoint import save_checkpoint
    from model.config import tiny
    from model.transformer import MoETransformer

    return save_checkpoint(MoETransformer(tiny()).init_weights(seed), directory, dtype=torch.bfloat16)


def choose_policy(args: argparse.Namespace, work_dir: Path) -> tuple[str, Path]:
    """(kind, checkpoint directory): given | starting | random."""
    if args.checkpoint is not None:
        return "given", args.checkpoint.resolve()
    cache = REPO / "runs" / "_cache"
    if args.policy == "starting":
        from actors.training.starting_policy import ensure_starting_policy

        return "starting", ensure_starting_policy(cache)
    cached = cached_starting_policy(cache) if args.policy == "auto" else None
    if cached is not None:
        return "starting", cached
    return "random", random_policy(work_dir / "random-policy", args.seed)


# --- one run ---------------------------------------------------------------------------------------
def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    return asyncio.run(read_run_metrics(run_dir, kind="train"))


def run_mode(args: argparse.Namespace, name: str, eta: int, checkpoint: Path, work_dir: Path) -> dict[str, Any]:
    """Starts runtime.up with this eta, waits for the last train row, stops the run; returns its figures."""
    run_file = RUN_FILE.format(
        mode=name.split("-")[0],
        seed=args.seed,
        steps=args.steps,
        checkpoint=checkpoint,
        eta=eta,
        num_slots=(max(eta, args.eta) + 1) * args.batch_groups * args.group_size,
        group_size=args.group_size,
        batch_groups=args.batch_groups,
        inflight=args.inflight,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
    )
    load_before = os.getloadavg()[0]
    run_dir, rows, exit_code = run_to_steps(name, [run_file], args.steps, args.run_timeout_s, work_dir)
    started_at = json.loads((run_dir / "run.json").read_text())["started_at"]
    figures = summarise(rows, started_at)
    return {
        "eta": eta,
        **figures,
        "lag_within_eta": figures["lag_max"] <= eta,
        **rollout_figures(run_dir),
        "exit_code": exit_code,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def run_to_steps(name: str, run_files: Sequence[str], steps: int, timeout_s: float,
                 work_dir: Path) -> tuple[Path, list[dict[str, Any]], int]:
    """Writes ``run_files`` (TOML texts layered in order over the default run), starts runtime.up on them, waits
    for ``steps`` train rows and stops the run: its directory, its first ``steps`` rows and runtime.up's exit
    code. Its output goes to ``work_dir/<name>.out``."""
    run_dir = work_dir / f"run-{name}"
    layered = ["--config", str(DEFAULT_RUN_FILE)]
    for i, text in enumerate(run_files):
        config = work_dir / f"{name}-{i}.toml"
        config.write_text(text)
        layered += ["--config", str(config)]
    with open(work_dir / f"{name}.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.up", *layered, "--run-dir", str(run_dir), "--quiet"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        rows = _wait_for_steps(proc, run_dir, steps, timeout_s, work_dir / f"{name}.out")
    finally:
        exit_code = _stop(proc)
    return run_dir, rows[:steps], exit_code


def _wait_for_steps(
    proc: subprocess.Popen[bytes], run_dir: Path, steps: int, timeout_s: float, output: Path
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    shown = 0
    while True:
        # runtime.up writes the run's address (run.json) once its bus is up; before it there are no rows to read
        rows = train_rows(run_dir) if (run_dir / "run.json").is_file() else []
        if len(rows) > shown:
            shown = len(rows)
            print(
                f"  {run_dir.name}: step {shown}/{steps} at {time.monotonic() - deadline + timeout_s:.0f}s",
                file=sys.stderr,
                flush=True,
            )
        if len(rows) >= steps:
            return rows
        if proc.poll() is not None:
            raise RuntimeError(
                f"runtime.up exited {proc.returncode} after {len(rows)} of {steps} steps; "
                f"its output ({output}):\n{output.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{run_dir.name}: {len(rows)} of {steps} steps within {timeout_s:.0f}s; "
                "raise --run-timeout-s or lower --steps / --max-new-tokens"
            )
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> int:
    """SIGTERM: runtime.up drains every actor; SIGKILL to its process group if it does not exit in time.

    Returns runtime.up's exit status (0: drained and stopped cleanly; negative: killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def rollout_figures(run_dir: Path) -> dict[str, Any]:
    """Rollouts finished during the run (trained or not) and their median duration, from the event logs."""
    durations = []
    for path in (run_dir / "logs").glob("rollout-*.jsonl"):
        for line in path.read_text().splitlines():
            if '"rollout_finished"' in line:
                durations.append(json.loads(line)["duration_s"])
    return {
        "num_rollouts_finished": len(durations),
        "rollout_s_median": round(statistics.median(durations), 3) if durations else None,
    }


# --- figures ---------------------------------------------------------------------------------------
def summarise(rows: list[dict[str, Any]], started_at: float) -> dict[str, Any]:
    """Throughput, utilisation and lag of one run's train rows (in step order)."""
    first, last = rows[0]["time"], rows[-1]["time"]
    steady_wall = last - first
    steady = rows[1:]
    from_start_wall = last - started_at
    lag_tokens: dict[int, int] = {}
    for row in rows:
        for lag, n in row["lag_histogram"].items():
            lag_tokens[int(lag)] = lag_tokens.get(int(lag), 0) + n
    num_tokens = sum(lag_tokens.values())
    return {
        "num_steps": len(rows),
        "num_samples": sum(r["num_samples"] for r in rows),
        "steady": {
            "wall_s": round(steady_wall, 2),
            "samples_per_s": round(sum(r["num_samples"] for r in steady) / steady_wall, 4),
            "trainer_utilisation": round(sum(r["step_s"] for r in steady) / steady_wall, 4),
        },
        "from_start": {
            "wall_s": round(from_start_wall, 2),
            "samples_per_s": round(sum(r["num_samples"] for r in rows) / from_start_wall, 4),
            "trainer_utilisation": round(sum(r["step_s"] for r in rows) / from_start_wall, 4),
        },
        "step_s_median": round(statistics.median(r["step_s"] for r in rows), 3),
        "step_interval_s_median": round(
            statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(rows)), 3
        ),
        "lag_tokens": lag_tokens,
        "lag_token_fraction": {str(k): round(lag_tokens[k] / num_tokens, 4) for k in sorted(lag_tokens)},
        "lag_mean": round(sum(k * n for k, n in lag_tokens.items()) / num_tokens, 4),
        "lag_max": max(r["lag_max"] for r in rows),
        "lag_min_max_per_step": [[r["lag_min"], r["lag_max"]] for r in rows],
        "num_versions_in_batch": [r["num_versions_in_batch"] for r in rows],
        "reward_mean": round(statistics.fmean(r["reward_mean"] for r in rows), 4),
    }


WINDOW_KEYS = ("wall_s", "samples_per_s", "trainer_utilisation")


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its repeats: median figures per window, the lag over every run, and each run."""
    pooled: dict[int, int] = {}
    for run in runs:
        for k, n in run["lag_tokens"].items():
            pooled[k] = pooled.get(k, 0) + n
    total = sum(pooled.values())
    return {
        "eta": runs[0]["eta"],
        "num_runs": len(runs),
        **{
            window: {key: round(statistics.median(r[window][key] for r in runs), 4) for key in WINDOW_KEYS}
            for window in ("steady", "from_start")
        },
        # Both share 2 cores in async mode: contention shows as slower steps and slower rollouts.
        "step_s_median": round(statistics.median(r["step_s_median"] for r in runs), 3),
        "rollout_s_median": round(statistics.median(r["rollout_s_median"] or 0.0 for r in runs), 3),
        "lag_token_fraction": {str(k): round(pooled[k] / total, 4) for k in sorted(pooled)},
        "lag_max": max(r["lag_max"] for r in runs),
        "lag_within_eta": all(r["lag_within_eta"] for r in runs),
        "runs": [{k: v for k, v in r.items() if k != "lag_tokens"} for r in runs],
    }


def ratios(fast: dict[str, Any], slow: dict[str, Any]) -> dict[str, float]:
    out = {}
    for window in ("steady", "from_start"):
        for key in ("samples_per_s", "trainer_utilisation"):
            out[f"{window}_{key}"] = round(fast[window][key] / slow[window][key], 3) if slow[window][key] else 0.0
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    etas = {"async": args.eta, "sync": 0}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        work_dir = args.keep.resolve() if args.keep else Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        kind, checkpoint = choose_policy(args, work_dir)
        print(f"policy: {kind} {checkpoint}", file=sys.stderr, flush=True)
        started = time.monotonic()
        runs: dict[str, list[dict[str, Any]]] = {"async": [], "sync": []}
        order = args.order.split(",")
        for repeat in range(args.repeats):
            for mode in order if repeat % 2 == 0 else order[::-1]:
                runs[mode].append(run_mode(args, f"{mode}-{repeat}", etas[mode], checkpoint, work_dir))
    modes = {mode: medians(results) for mode, results in runs.items()}
    return {
        "bench": "e2e",
        "policy": {"kind": kind, "checkpoint": str(checkpoint)},
        "config": {
            "steps": args.steps,
            "group_size": args.group_size,
            "batch_groups": args.batch_groups,
            "inflight": args.inflight,
            "max_turns": args.max_turns,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "order": args.order,
            "repeats": args.repeats,
            "tasks": "default",
            "evaluator": False,
        },
        "async": modes["async"],
        "sync": modes["sync"],
        "ratio_async_over_sync": ratios(modes["async"], modes["sync"]),
        "ratio_steady_samples_per_s_per_repeat": [
            round(a["steady"]["samples_per_s"] / s["steady"]["samples_per_s"], 3)
            for a, s in zip(runs["async"], runs["sync"], strict=True)
        ],
        "bench_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: one JSON line
    print(json.dumps(main()))
