"""Throughput of the lifecycle core alone: no-op stages, in-memory compare-and-set store.

Every work order the core returns is completed at once (FIFO), so the figure is the core's own
cost per transition: encoding each slot record, the compare-and-set write, the bookkeeping and
the scheduling decisions. The NATS-backed version of this benchmark is tests/bench/lifecycle.py.

Peer, in the same process: a bare state machine moving the same samples through the same states
in plain dicts (no records, no store, no scheduling): the floor the core's overhead is measured
against. Prints one JSON line with medians over repeats.

Run: .venv/bin/python -m tests.bench.lifecycle_core
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time

from actors import (
    GroupDone,
    GroupOrder,
    Lifecycle,
    LifecycleConfig,
    ListTaskSource,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    SchedulingConfig,
    TrainDone,
    TrainOrder,
)
from actors.testing import InMemorySlotStore


def completion_for(order, version: int):
    match order:
        case RolloutOrder():
            return RolloutDone(order.sample_id, order.attempt, "t", order.policy_version_floor, version, order.token)
        case RewardOrder():
            return RewardDone(order.sample_id, order.attempt, "r", order.token)
        case GroupOrder():
            return GroupDone(order.group_id, order.attempt, "g", order.token)
        case TrainOrder():
            return TrainDone(order.batch_id, order.attempt, order.trainer_version + 1, order.token)
    raise TypeError(order)


async def run_core(args: argparse.Namespace) -> dict:
    config = LifecycleConfig(
        num_slots=args.num_slots,
        group_size=args.group_size,
        batch_size_groups=args.batch_groups,
        scheduling=SchedulingConfig(eta=args.eta, max_inflight_per_rollout_actor=args.num_slots),
        transition_events_per_s=0,
    )
    store = InMemorySlotStore()
    source = ListTaskSource.numbered(args.num_samples // args.group_size)
    started = time.perf_counter()
    resumed = await Lifecycle.resume(store, source, config, 0.0, num_rollout_actors=1)
    core = resumed.lifecycle
    pending = collections.deque(resumed.orders)
    latencies: list[float] = []
    version = 0
    while pending:
        order = pending.popleft()
        if isinstance(order, TrainOrder):
            version = order.trainer_version + 1
        t0 = time.perf_counter()
        pending.extend(await core.on_completion(completion_for(order, version), time.perf_counter()))
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    assert core.is_finished
    snapshot = core.snapshot(time.perf_counter())
    latencies.sort()
    return {
        "samples_per_s": snapshot.counters["trained_samples"] / elapsed,
        "transitions_per_s": snapshot.counters["transitions"] / elapsed,
        "store_writes_per_sample": store.num_writes / snapshot.counters["trained_samples"],
        "call_p50_us": latencies[len(latencies) // 2] * 1e6,
        "call_p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
    }


def run_bare(args: argparse.Namespace) -> dict:
    """The peer: the same states in dicts, FIFO, batches of B groups, nothing durable."""
    started = time.perf_counter()
    states: dict[str, str] = {}
    queue = collections.deque(f"s{i}" for i in range(args.num_samples))
    ready: list[str] = []
    num_transitions = 0
    for stage in ("rollout", "reward", "group", "ready"):
        for sample in queue:
            states[sample] = stage
            num_transitions += 1
    batch_samples = args.group_size * args.batch_groups
    for sample in queue:
        ready.append(sample)
        if len(ready) == batch_samples:
            for s in ready:
                states[s] = "train"
            for s in ready:
                del states[s]
            num_transitions += 2 * len(ready)
            ready.clear()
    elapsed = time.perf_counter() - started
    return {"samples_per_s": args.num_samples / elapsed, "transitions_per_s": num_transitions / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=20_000)
    parser.add_argument("--num-slots", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--eta", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    core = [asyncio.run(run_core(args)) for _ in range(args.repeats)]
    bare = [run_bare(args) for _ in range(args.repeats)]

    def median(runs: list[dict], key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 1)

    result = {
        "bench": "lifecycle_core",
        "params": vars(args),
        "core": {k: median(core, k) for k in core[0]},
        "bare_dict_peer": {k: median(bare, k) for k in bare[0]},
    }
    result["ratio_core_over_peer_samples_per_s"] = round(
        result["core"]["samples_per_s"] / result["bare_dict_peer"]["samples_per_s"], 5
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
