"""Asynchronous vs synchronous RL throughput, simulated: the real lifecycle core, simulated stages.

A discrete-event simulation (no NATS, virtual time) drives `actors.Lifecycle` with an in-memory
store. Rollouts take lognormal times (agent rollouts are long-tailed), reward and grouping take a
small fixed time, the trainer a fixed time per step. Rollout capacity is the same in every mode
(num_rollout_actors × max_inflight_per_rollout_actor concurrent rollouts, one batch worth), and
so is the trainer: the modes differ only in the staleness bound eta.

- synchronous: eta = 0. The core then admits one batch, waits for its slowest rollout, trains,
  and only then admits the next: generation and training never overlap (the disaggregated
  synchronous baseline; a colocated one would also share the GPUs, which this does not model).
  An independent closed-form simulation of the same synchronous loop is printed as a check.
- asynchronous: eta = 1, 2, 4, same capacity, the core's admission rule and batch gate.

Metric: trained samples per simulated second, median over seeds; the ratio async / sync; and the
lag distribution (trainer version − oldest token version at training) per eta. Rollout actors
generate with the newest weights when they start (in-flight weight updates are not modelled).

This is a simulation, not a measurement of the system: its line says so (``"simulation": true``)
and names the bench that measures the real run, ``tests.bench.e2e`` (the same comparison with the
real actors, sandboxes, model and NATS).

Run: .venv/bin/python -m tests.bench.async_vs_sync   (prints one JSON line)
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import statistics

import numpy as np

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

NEVER = 1e12


class Simulation:
    """Event loop in virtual time: work orders become completions after simulated durations."""

    def __init__(self, args: argparse.Namespace, eta: int, seed: int) -> None:
        self.args = args
        self.eta = eta
        self.rng = np.random.default_rng(seed)
        self.events: list[tuple[float, int, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.trainer_version = 0
        self.trainer_free_at = 0.0
        self.trained_samples = 0

    def config(self) -> LifecycleConfig:
        a = self.args
        batch_samples = a.group_size * a.batch_groups
        return LifecycleConfig(
            num_slots=batch_samples * (self.eta + 2),
            group_size=a.group_size,
            batch_size_groups=a.batch_groups,
            scheduling=SchedulingConfig(
                eta=self.eta,
                max_inflight_per_rollout_actor=batch_samples // a.num_actors,
                rollout_timeout_s=NEVER,
                reward_timeout_s=NEVER,
                group_timeout_s=NEVER,
                train_timeout_s=NEVER,
            ),
            transition_events_per_s=0,
        )

    def schedule(self, orders: list) -> None:
        a = self.args
        for order in orders:
            match order:
                case RolloutOrder():
                    duration = float(self.rng.lognormal(a.rollout_mu, a.rollout_sigma))
                    version = self.trainer_version
                    done = RolloutDone(order.sample_id, order.attempt, "t", version, version, order.token)
                    heapq.heappush(self.events, (self.now + duration, next(self.seq), done))
                case RewardOrder():
                    done = RewardDone(order.sample_id, order.attempt, "r", order.token)
                    heapq.heappush(self.events, (self.now + a.reward_s, next(self.seq), done))
                case GroupOrder():
                    done = GroupDone(order.group_id, order.attempt, "g", order.token)
                    heapq.heappush(self.events, (self.now + a.group_s, next(self.seq), done))
                case TrainOrder():
                    start = max(self.now, self.trainer_free_at)
                    self.trainer_free_at = start + a.train_step_s
                    self.pending_train = (order, len(order.sample_ids))
                    done = TrainDone(order.batch_id, order.attempt, -1, order.token)
                    heapq.heappush(self.events, (self.trainer_free_at, next(self.seq), done))

    async def run(self) -> dict:
        a = self.args
        source = ListTaskSource.numbered(a.num_steps * a.batch_groups)
        resumed = await Lifecycle.resume(
            InMemorySlotStore(), source, self.config(), 0.0, num_rollout_actors=a.num_actors
        )
        core = resumed.lifecycle
        self.schedule(list(resumed.orders))
        while self.events:
            self.now, _, event = heapq.heappop(self.events)
            if isinstance(event, TrainDone):
                self.trainer_version += 1
                self.trained_samples += self.pending_train[1]
                event = TrainDone(event.batch_id, event.attempt, self.trainer_version, event.token)
            self.schedule(await core.on_completion(event, self.now))
        assert core.is_finished, core.snapshot(self.now)
        lag = core.snapshot(self.now).lag_histogram
        return {"samples_per_s": self.trained_samples / self.now, "lag": lag, "steps": self.trainer_version}


def sync_closed_form(args: argparse.Namespace, seed: int) -> float:
    """Independent check: step time = slowest of one batch's rollouts + reward + group + train."""
    rng = np.random.default_rng(seed)
    batch_samples = args.group_size * args.batch_groups
    total = 0.0
    for _ in range(args.num_steps):
        total += float(rng.lognormal(args.rollout_mu, args.rollout_sigma, batch_samples).max())
        total += args.reward_s + args.group_s + args.train_step_s
    return args.num_steps * batch_samples / total


def lag_fractions(histograms: list[dict[int, int]]) -> dict[str, float]:
    total: dict[int, int] = {}
    for h in histograms:
        for k, v in h.items():
            total[k] = total.get(k, 0) + v
    n = sum(total.values())
    return {str(k): round(v / n, 4) for k, v in sorted(total.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--num-actors", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=60)
    parser.add_argument("--rollout-mu", type=float, default=0.0, help="lognormal mu of rollout seconds")
    parser.add_argument("--rollout-sigma", type=float, default=1.0, help="lognormal sigma (long tail)")
    parser.add_argument("--reward-s", type=float, default=0.05)
    parser.add_argument("--group-s", type=float, default=0.01)
    parser.add_argument("--train-step-s", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    seeds = range(args.seeds)
    sync_runs = [asyncio.run(Simulation(args, 0, seed).run()) for seed in seeds]
    sync = statistics.median(r["samples_per_s"] for r in sync_runs)
    result: dict = {
        "bench": "async_vs_sync",
        "simulation": True,
        "model": "discrete-event simulation driving actors.Lifecycle; equal rollout capacity and trainer",
        "real_run_bench": "tests.bench.e2e",
        "params": {k: v for k, v in vars(args).items() if k != "etas"},
        "sync_samples_per_s": round(sync, 3),
        "sync_closed_form_samples_per_s": round(statistics.median(sync_closed_form(args, s) for s in seeds), 3),
        "sync_lag": lag_fractions([r["lag"] for r in sync_runs]),
        "async": {},
        "areal_reported_ratio": 2.77,
    }
    for eta in args.etas:
        runs = [asyncio.run(Simulation(args, eta, seed).run()) for seed in seeds]
        rate = statistics.median(r["samples_per_s"] for r in runs)
        result["async"][f"eta={eta}"] = {
            "samples_per_s": round(rate, 3),
            "ratio_vs_sync": round(rate / sync, 3),
            "lag": lag_fractions([r["lag"] for r in runs]),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
