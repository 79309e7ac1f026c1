"""Benchmark: what the live dashboard costs a real run, open (served and watched) vs closed (not running).

    .venv/bin/python -m tests.bench.dashboard_cost [--trials 2] [--warmup-versions 1] [--window-s 120]

Runs the default job for real (``python -m actors``: the shipped policy, sandboxed rewards, the whole
pipeline) once per mode and trial, the modes interleaved so that both see the same machine:

- open: the dashboard actor as the default run has it, watched the way an operator watches it: one live
  browser stream (``/api/stream``, every update read), the rollout list refreshed every 5 s and a sample
  opened, and a Prometheus scrape of ``/metrics`` every 15 s (Prometheus' default interval);
- closed: ``actors.dashboard.count = 0``.

Once the trainer has published ``--warmup-versions`` versions, for ``--window-s`` seconds: samples/s (rollouts
finished, from the reconciler's own slot transitions) and each process's CPU seconds (/proc). The bar:
the dashboard costs <= 2% of samples/s. On a shared 2-core machine two runs one after the other
differ by more than that, so the robust figures beside the ratio are the dashboard process's CPU: its share
of the run's CPU in the open run, and its share of the machine's capacity (CPU seconds over window x cores:
what a run that fills the machine gives up to it, an upper bound of its cost in samples/s when the run is
CPU-bound; the share of the run's CPU overstates it when other work on the machine starves the run).
Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.failover import _rollouts_done, _wait, stop_run
from tests.bench.lifecycle import cpu_by_role
from tests.integration.harness import run_events

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 300.0


async def _watch(url: str, window_s: float) -> dict[str, int]:
    """An operator's load for ``window_s``: the live stream read, the sample list refreshed, scrapes."""
    seen = {"stream_bytes": 0, "sample_lists": 0, "samples_opened": 0, "scrapes": 0}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def stream() -> None:
            async with http.get(url + "api/stream") as reply:
                async for chunk in reply.content.iter_any():
                    seen["stream_bytes"] += len(chunk)

        async def every(period_s: float, visit: Any) -> None:
            while True:
                await visit()
                await asyncio.sleep(period_s)

        async def samples() -> None:
            async with http.get(url + "api/samples") as reply:
                rows = (await reply.json())["samples"]
            seen["sample_lists"] += 1
            if rows:
                async with http.get(url + f"api/samples/{rows[0]['sample_id']}") as reply:
                    await reply.read()
                seen["samples_opened"] += 1

        async def scrape() -> None:
            async with http.get(url + "metrics") as reply:
                await reply.read()
            seen["scrapes"] += 1

        tasks = [asyncio.create_task(t) for t in (stream(), every(5.0, samples), every(15.0, scrape))]
        try:
            await asyncio.sleep(window_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return seen


def trial(mode: str, args: argparse.Namespace, out_dir: Path, n: int) -> dict[str, Any]:
    run_dir = out_dir / f"{mode}-{n}"
    cmd = [sys.executable, "-m", "actors", "--quiet", "--run-dir", str(run_dir), "--set", "run.steps=0",
           "--set", "eval.every_versions=1000000", "--set", "dashboard.port=0"]
    if mode == "closed":
        cmd += ["--set", "actors.dashboard.count=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait(f"version {args.warmup_versions}", STARTUP_S, lambda: True if any(
            e.get("version", 0) >= args.warmup_versions for e in run_events(run_dir, "weights_announced")) else None)
        url = None
        if mode == "open":
            serving = _wait("the dashboard serving", STARTUP_S,
                            lambda: run_events(run_dir, "dashboard_serving") or None)
            url = serving[0]["url"].rstrip("/") + "/"
        cpu_before, start = cpu_by_role(proc.pid), time.time()
        seen: dict[str, int] = {}
        if url:
            seen = asyncio.run(_watch(url, args.window_s))
        else:
            time.sleep(args.window_s)
        cpu_after, end = cpu_by_role(proc.pid), time.time()
        done = [t for t in _rollouts_done(run_dir) if start <= t < end]
        cpu = {role: round(cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0), 2) for role in cpu_after}
        total = sum(cpu.values())
        return {"mode": mode, "samples_per_s": round(len(done) / (end - start), 4), "cpu_s": cpu,
                "dashboard_cpu_share": round(cpu.get("dashboard", 0.0) / total, 4) if total else None,
                # of the machine's capacity (every core for the window): what a run that fills the machine
                # gives up to it, whatever else shares the machine during the measurement
                "dashboard_machine_share": round(cpu.get("dashboard", 0.0) / ((end - start) * os.cpu_count()), 4),
                "watched": seen, "load_avg_1m": round(os.getloadavg()[0], 2), "run_dir": str(run_dir)}
    finally:
        stop_run(proc)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--warmup-versions", type=int, default=1)
    p.add_argument("--window-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None, help="run directories go here (default: a temporary one)")
    args = p.parse_args(argv)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    trials = []
    for n in range(args.trials):
        for mode in (("open", "closed") if n % 2 == 0 else ("closed", "open")):  # alternate who goes first
            result = trial(mode, args, out_dir, n)
            print(f"trial {n}: {result}", file=sys.stderr)
            trials.append(result)
    rate = {m: statistics.median(t["samples_per_s"] for t in trials if t["mode"] == m) for m in ("open", "closed")}
    share = [t["dashboard_cpu_share"] for t in trials if t["mode"] == "open"]
    machine = [t["dashboard_machine_share"] for t in trials if t["mode"] == "open"]
    line = {"bench": "dashboard_cost", "samples_per_s_median": rate,
            "ratio_open_over_closed": round(rate["open"] / rate["closed"], 3) if rate["closed"] else None,
            "dashboard_cpu_share_median": statistics.median(share),
            "dashboard_machine_share_median": statistics.median(machine), "window_s": args.window_s,
            "trials": trials}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
