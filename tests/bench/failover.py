"""Benchmark: from kill -9 of the rollout actor to rollout capacity restored, warm standby vs cold restart.

    .venv/bin/python -m tests.bench.failover [--trials 2] [--warmup-versions 2] [--window-s 20]

Runs the default job for real (``python -m actors``: the shipped policy, sandboxed rewards, the whole
pipeline) once per mode and trial: ``actors.rollout.standby = 1`` (a spare set up, model loaded, not
consuming) or 0 (the supervisor's cold restart: a new process imports torch, loads the policy, starts
its engine). Once the trainer has published ``--warmup-versions`` versions, the running rollout actor
is killed with SIGKILL; restored = the time from the kill to the replacement taking work (the spare's
``actor_activated``, or the new process's ``actor_running``), from the run's own event logs. The dip:
rollouts finished in the ``--window-s`` seconds after the kill over those in as many seconds before
(1 = no dip). Prints ONE JSON line; the ratio is cold / standby restore time (the goal: >= 10).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.tail import event_time
from tests.integration.harness import run_events

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 300.0  # the run up and trained to the warm-up version within this, or the trial fails
RESTORE_S = 300.0


def _when(event: dict[str, Any]) -> float:
    when = event_time(event)
    assert when is not None, f"an event without a readable time: {event}"
    return when.timestamp()


def _wait(what: str, timeout_s: float, found: Any) -> Any:
    """A bench waits on a run's log files, which are files: read them again every half second."""
    deadline = time.monotonic() + timeout_s
    while (result := found()) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"failover bench: {what} not within {timeout_s}s")
        time.sleep(0.5)
    return result


def _rollouts_done(run_dir: Path) -> list[float]:
    return sorted(_when(e) for e in run_events(run_dir, "slot_transition")
                  if e.get("from_state") == "rollout" and e.get("to_state") == "reward")


def trial(standby: bool, args: argparse.Namespace, out_dir: Path, n: int) -> dict[str, Any]:
    run_dir = out_dir / f"{'standby' if standby else 'cold'}-{n}"
    cmd = [sys.executable, "-m", "actors", "--quiet", "--run-dir", str(run_dir), "--set", "run.steps=0",
           "--set", f"actors.rollout.standby={int(standby)}", "--set", "actors.dashboard.count=0",
           "--set", "eval.every_versions=1000000"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait(f"version {args.warmup_versions}", STARTUP_S, lambda: True if any(
            e.get("version", 0) >= args.warmup_versions for e in run_events(run_dir, "weights_announced")) else None)
        if standby:
            _wait("a rollout spare standing by", STARTUP_S, lambda: run_events(run_dir, "actor_standing_by") or None)
        (victim,) = [e for e in run_events(run_dir, "actor_running") if e["kind"] == "rollout"]
        time.sleep(args.window_s)  # a full window of steady work before the kill
        killed_at = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        marker = "actor_activated" if standby else "actor_running"

        def replacement() -> float | None:
            times = [_when(e) for e in run_events(run_dir, marker)
                     if e["kind"] == "rollout" and e["actor"] != victim["actor"] and _when(e) >= killed_at - 1]
            return min(times) if times else None

        restored_at = _wait("the replacement taking work", RESTORE_S, replacement)
        time.sleep(args.window_s)
        done = _rollouts_done(run_dir)
        before = sum(killed_at - args.window_s <= t < killed_at for t in done)
        after = sum(killed_at <= t < killed_at + args.window_s for t in done)
        return {"mode": "standby" if standby else "cold", "restore_s": round(restored_at - killed_at, 3),
                "rollouts_before": before, "rollouts_after": after,
                "throughput_kept": round(after / before, 3) if before else None, "run_dir": str(run_dir)}
    finally:
        stop_run(proc)


def stop_run(proc: subprocess.Popen) -> None:
    """A bench's run stopped as an operator would (SIGTERM: every actor drains), killed if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--warmup-versions", type=int, default=2)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=None, help="run directories go here (default: a temporary one)")
    args = p.parse_args(argv)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench-failover-"))
    trials = []
    for n in range(args.trials):
        for standby in (True, False):  # interleaved: both modes see the same machine
            result = trial(standby, args, out_dir, n)
            print(f"trial {n}: {result}", file=sys.stderr)
            trials.append(result)
    median = {mode: statistics.median(t["restore_s"] for t in trials if t["mode"] == mode)
              for mode in ("standby", "cold")}
    kept = {mode: [t["throughput_kept"] for t in trials if t["mode"] == mode] for mode in ("standby", "cold")}
    line = {"bench": "failover", "restore_s_median": median,
            "ratio_cold_over_standby": round(median["cold"] / median["standby"], 1) if median["standby"] else None,
            "throughput_kept_after_kill": kept, "window_s": args.window_s, "load_avg_1m": round(os.getloadavg()[0], 2),
            "trials": trials}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
