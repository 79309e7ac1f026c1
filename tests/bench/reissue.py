"""Benchmark: from a rollout actor lost to its episodes re-issued, against the rollout timeout.

    .venv/bin/python -m tests.bench.reissue [--trials 2] [--lease-s 10] [--servers 1|3]

A run of the real reconciler and the simulated stages (tests/integration/sim_stages.py: rollouts of
4 s, two rollout actors), ``rollout_timeout_s`` = 120 s (the default) and the bus's ack wait 90 s, so
that neither brings the work back within the measurement. Once a rollout actor holds rollouts it is
lost, two ways per trial:

- ``kill``: SIGKILL; the supervisor sees the exit and removes its registry entry;
- ``freeze``: SIGSTOP; alive to the supervisor, silent on the bus; only its lease can tell (the
  reconciler's bound on the last renewal it saw, or the bus expiring the entry's TTL).

Re-issued = the first ``work_retried`` event naming the actor as lost, from the run's own event
logs; the time is from the signal. Prints ONE JSON line (seconds; ``rollout_timeout_s`` for scale).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.tail import event_time
from runtime.bus_auth import control_subject
from tests.integration.harness import LiveRun, run_events, write_config
from tests.integration.sim_stages import SimConfig, StageSim, sim_run_toml
from tests.waiting import until

ROLLOUT_TIMEOUT_S = 120.0


async def _victim(run: LiveRun) -> dict[str, Any]:
    async def holding_work() -> dict[str, Any] | None:
        for actor in await run.actors():
            if actor["kind"] == "rollout":
                info = await run.request(control_subject("rollout", actor["id"], "status"))
                if info["state"] == "running" and info["num_inflight"] >= 1:
                    return info
        return None

    return await until(holding_work, 120, "a rollout actor holding rollouts")


async def trial(how: str, args: argparse.Namespace, out_dir: Path, n: int) -> float:
    run_dir = out_dir / f"{how}-{n}"
    SimConfig(rollout=StageSim(median_s=4.0, sigma=0.0, max_s=4.0)).write(run_dir)
    cfg = write_config(out_dir / f"{how}-{n}.toml", sim_run_toml(
        num_prompts=64, num_slots=16, group_size=2, batch_groups=1, eta=1, rollout_count=2, reward_count=1,
        stage_timeout_s=ROLLOUT_TIMEOUT_S))
    run = await LiveRun(run_dir, cfg, "--set", "bus.ack_wait_s=90", "--set", f"actors.rollout.lease_s={args.lease_s}",
                        "--set", f"bus.embedded_servers={args.servers}").start(timeout_s=120)
    victim: dict[str, Any] = {}
    try:
        await run.wait_actors("rollout", 2, timeout_s=120)
        victim = await _victim(run)
        os.kill(victim["pid"], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        lost_at = time.time()
        reason = f"actor {victim['id']} lost"

        def reissued() -> list[dict[str, Any]]:
            return [e for e in run_events(run_dir, "work_retried") if e.get("reason") == reason]

        events = await until(reissued, ROLLOUT_TIMEOUT_S, f"{victim['id']}'s rollouts re-issued")
    finally:
        if victim and how == "freeze":
            os.kill(victim["pid"], signal.SIGKILL)
        await run.stop()
    first = min(t.timestamp() for e in events if (t := event_time(e)) is not None)
    return first - lost_at


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[float]] = {"kill": [], "freeze": []}
    with tempfile.TemporaryDirectory(prefix="bench-reissue-") as tmp:
        for n in range(args.trials):
            for how in ("kill", "freeze"):
                results[how].append(round(await trial(how, args, Path(tmp), n), 3))
    return {"bench": "reissue", "servers": args.servers, "lease_s": args.lease_s,
            "rollout_timeout_s": ROLLOUT_TIMEOUT_S, "load": round(os.getloadavg()[0], 2),
            **{f"{how}_s": values for how, values in results.items()},
            **{f"{how}_median_s": round(statistics.median(v), 3) for how, v in results.items()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--lease-s", type=float, default=10.0)
    parser.add_argument("--servers", type=int, default=1, choices=(1, 3), help="bus.embedded_servers")
    print(json.dumps(asyncio.run(main(parser.parse_args(sys.argv[1:])))), flush=True)
