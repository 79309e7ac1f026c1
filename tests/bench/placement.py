"""Benchmark: the Ray placement backend vs the local one, and ready samples in the object store vs the blob store.

    .venv/bin/python -m tests.bench.placement [--actors 4] [--prompts 200] [--trials 2] [--sizes-kib 16 256 4096]

- Start-up: a run of ``--actors`` counter actors (tests/integration/workers.py) under each backend; per
  actor, the seconds from the supervisor's ``actor_starting`` to the actor's own ``actor_running`` (a Ray
  worker started and the host placed, then the same process start as the local backend); from the first
  ``actor_starting`` to the last ``actor_running`` (placing them all: the sum of the starts if they were
  placed one at a time); and from ``runtime.up``'s launch to every actor running (the Ray side includes
  its local head's start).
- Throughput: ``tests.bench.lifecycle``'s NATS side (the real reconciler, the simulated no-op stages,
  one process per kind) under each backend, lifecycles/s in the steady span.
- Fetch: a trainer's batch (``--batch-groups`` group checkpoints of each size) from the Ray object store
  (a local head, the holder on it, the reader on the same node), one key at a time
  (`runtime.ready_samples.ReadySamples.get`) and batched as the trainer reads it (``get_many``: one
  holder call, the fetches together), vs the file blob store (`runtime.blob`, one by one), median ms.
  ``--trials 0`` measures only this.

The sides alternate within each trial, so the machine's load hits both alike. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from ops.tail import event_time
from runtime.blob import open_store
from tests.bench.lifecycle import RECONCILERS, _median_of, nats_trial
from tests.integration.harness import LiveRun, run_events

RAY_ARGS = ("--set", 'runtime.backend="ray"', "--set", "runtime.ray_head_num_cpus=2")
BACKEND_ARGS: dict[str, tuple[str, ...]] = {"local": (), "ray": RAY_ARGS}
COUNTER_RUN = """
[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = {count}
"""


def _epoch(row: dict[str, Any]) -> float:
    when = event_time(row)
    assert when is not None, row
    return when.timestamp()


async def startup_trial(backend: str, num_actors: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    try:
        config = work / "run.toml"
        config.write_text(COUNTER_RUN.format(count=num_actors))
        launched = time.time()
        run = await LiveRun(work / "run", config, *BACKEND_ARGS[backend]).start(timeout_s=180)
        try:
            await run.wait_actors("counter", num_actors, timeout_s=300)
            all_running_s = time.time() - launched
        finally:
            await run.stop(timeout_s=120)
        starting = {r["actor_id"]: _epoch(r) for r in run_events(run.run_dir, "actor_starting")}
        running = {r["actor"]: _epoch(r) for r in run_events(run.run_dir, "actor_running")}
        per_actor = [running[a] - t for a, t in starting.items() if a in running]
        return {"actor_start_s_median": statistics.median(per_actor), "actor_start_s_max": max(per_actor),
                "first_start_to_all_running_s": max(running[a] for a in starting if a in running)
                - min(starting.values()),
                "launch_to_all_running_s": all_running_s}
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def lifecycle_trial(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-placement-lc-"))
    try:
        result = await nats_trial(args, work, RECONCILERS["nats"], extra=BACKEND_ARGS[backend])
        return {"lifecycles_per_s": result["lifecycles_per_s"], "cpu_ms_per_lifecycle": result["cpu_ms_per_lifecycle"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def fetch_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Median ms to read one batch through each store, per group size."""
    import ray

    from runtime.ready_samples import ReadySamples, holder_namespace, kill_holder

    work = Path(tempfile.mkdtemp(prefix="bench-placement-fetch-"))
    namespace = holder_namespace(str(work))
    ray.init(address="local", num_cpus=1, namespace=namespace, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, configure_logging=False)
    try:
        blob = open_store((work / "blobs").as_uri())
        ready = ReadySamples(ray.get_runtime_context().gcs_address, namespace)
        out: dict[str, Any] = {}
        for size_kib in args.sizes_kib:
            keys = [f"groups/s{size_kib}-g{i}/a0" for i in range(args.batch_groups)]
            for key in keys:
                data = os.urandom(size_kib * 1024)  # compressed checkpoints: incompressible bytes
                await blob.put(key, data)
                assert await ready.put(key, data), "the object store refused a put"
            times: dict[str, list[float]] = {"object_store": [], "object_store_batched": [], "blob_store": []}
            for _ in range(args.fetch_reps):  # alternating, so a busy moment hits both
                started = time.perf_counter()
                got = [await ready.get(k) for k in keys]
                times["object_store"].append(time.perf_counter() - started)
                assert all(g is not None and len(g) == size_kib * 1024 for g in got)
                started = time.perf_counter()
                got = await ready.get_many(keys)  # as the trainer reads a batch (actors._stage.get_records)
                times["object_store_batched"].append(time.perf_counter() - started)
                assert all(g is not None and len(g) == size_kib * 1024 for g in got)
                started = time.perf_counter()
                got_blob = [await blob.get(k) for k in keys]
                times["blob_store"].append(time.perf_counter() - started)
                assert all(len(g) == size_kib * 1024 for g in got_blob)
            medians = {side: round(1e3 * statistics.median(t), 3) for side, t in times.items()}
            out[f"{size_kib}KiB_x{args.batch_groups}"] = {
                **{f"{side}_ms": ms for side, ms in medians.items()},
                "ratio_batched_object_over_blob": round(medians["object_store_batched"] / medians["blob_store"], 3)}
        return out
    finally:
        kill_holder(namespace)
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    startup: dict[str, list[dict[str, Any]]] = {b: [] for b in args.backends}
    lifecycle: dict[str, list[dict[str, Any]]] = {b: [] for b in args.backends}
    for trial in range(args.trials):
        order = args.backends if trial % 2 == 0 else list(reversed(args.backends))
        for backend in order:
            startup[backend].append(await startup_trial(backend, args.actors))
        for backend in order:
            lifecycle[backend].append(await lifecycle_trial(backend, args))
        print(f"trial {trial}: startup {[(b, s[-1]) for b, s in startup.items()]} "
              f"lifecycle {[(b, s[-1]['lifecycles_per_s']) for b, s in lifecycle.items()]}", file=sys.stderr)
    result: dict[str, Any] = {
        "bench": "placement",
        "params": vars(args),
        "cpus": os.cpu_count(),
        "startup": {b: _median_of(t) for b, t in startup.items() if t},
        "lifecycle": {b: _median_of(t) for b, t in lifecycle.items() if t},
        "fetch_batch": await fetch_bench(args) if args.sizes_kib else {},
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    if {"local", "ray"} <= set(result["lifecycle"]):
        result["ratio_lifecycles_per_s_ray_over_local"] = round(
            result["lifecycle"]["ray"]["lifecycles_per_s"] / result["lifecycle"]["local"]["lifecycles_per_s"], 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=lambda v: v.split(","), default=["local", "ray"])
    p.add_argument("--actors", type=int, default=4, help="counter actors started per start-up trial")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--prompts", type=int, default=200, help="groups per lifecycle trial")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=8, help="groups per batch (lifecycle and fetch)")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--max-inflight-per-rollout-actor", type=int, default=0)
    p.add_argument("--auth", choices=["on", "off"], default="on")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--sizes-kib", type=int, nargs="*", default=[16, 256, 4096],
                   help="group checkpoint sizes for the fetch bench (none: skip it)")
    p.add_argument("--fetch-reps", type=int, default=20)
    args = p.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import uvloop

    print(json.dumps(uvloop.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
