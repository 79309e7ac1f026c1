"""Benchmark: how evenly a batch's sequences spread over data-parallel ranks, by three assignments.

- ``lpt``: model.packing.assign_to_ranks, the trainer's own: longest-processing-time greedy on the
  attention-aware cost n*linear + n^2*quadratic of the policy's config;
- ``tokens``: the same greedy on the token count alone (attention-blind balancing);
- ``round_robin``: sequence i to rank i mod R, in the batch's order (groups one after another);
- ``bound``: what no assignment can beat (the longest sequence alone, or a perfect split).

The figure is max/mean rank cost (1.0 = perfect; the step waits for the slowest rank), always measured with
the attention-aware cost, over ``--batches`` batches of the default run's size (8 groups x 8 samples)
drawn from two length distributions:

- ``default_run``: the lengths of real episodes of the shipped starting policy on the default run's
  training tasks (the agent loop with sandboxed tool calls, temperature 1, 8 samples per task: what the
  rollout actor produces at version 0), drawn whole groups at a time;
- ``long_tailed``: synthetic agentic lengths: lognormal around a median of 2,000 tokens with one
  sequence in 20 ten times the median (a few long tool-heavy episodes).

Prints a table and ONE JSON line.

    .venv/bin/python -m tests.bench.packing                     # ~2-5 minutes on 2 cores (the episodes)
    .venv/bin/python -m tests.bench.packing --tasks 32 --batches 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence

import structlog

from actors.agent.policy import load_policy
from actors.config import PolicySection, RolloutSection, TasksSection
from actors.task_catalog import TaskCatalog
from actors.training.evaluation import evaluate, sampled
from model.config import ModelConfig
from model.packing import SequenceCost, assign_to_ranks

GROUP_SIZE, GROUPS_PER_BATCH = 8, 8  # the default run's reconciler.group_size, batch_size_groups
RANKS = (2, 4, 8)

Assign = Callable[[Sequence[int], int, SequenceCost], list[list[int]]]


def round_robin(lengths: Sequence[int], num_ranks: int, cost: SequenceCost) -> list[list[int]]:
    return [list(range(r, len(lengths), num_ranks)) for r in range(num_ranks)]


def by_tokens(lengths: Sequence[int], num_ranks: int, cost: SequenceCost) -> list[list[int]]:
    return assign_to_ranks(lengths, num_ranks, SequenceCost(1.0, 0.0))


STRATEGIES: dict[str, Assign] = {"lpt": assign_to_ranks, "tokens": by_tokens, "round_robin": round_robin}


def imbalance(lengths: Sequence[int], parts: list[list[int]], cost: SequenceCost) -> float:
    loads = [sum(cost(lengths[i]) for i in part) for part in parts]
    return max(loads) / (sum(loads) / len(loads))


def default_run_groups(num_tasks: int, seed: int) -> list[list[int]]:
    """Episode lengths (tokens) of the starting policy on the default run's training tasks, per group."""
    policy = load_policy(PolicySection(device="cpu"))
    tasks = TaskCatalog.build(TasksSection()).train
    rng = random.Random(seed)
    chosen = rng.sample(list(tasks), num_tasks)
    rollout = RolloutSection()
    result = asyncio.run(evaluate(policy, chosen, sampling=sampled(rollout.temperature, rollout.top_p, seed),
                                  agent_config=rollout.agent, samples_per_task=GROUP_SIZE, concurrency=32))
    groups: dict[str, list[int]] = {}
    for ep in result.episodes:
        groups.setdefault(ep.task_id, []).append(ep.num_tokens)
    return list(groups.values())


def long_tailed_groups(num_groups: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    median = 2000

    def one() -> int:
        n = rng.lognormvariate(0.0, 0.35) * median
        return int(n * 10 if rng.random() < 0.05 else n)

    return [[one() for _ in range(GROUP_SIZE)] for _ in range(num_groups)]


def lower_bound(lengths: Sequence[int], num_ranks: int, cost: SequenceCost) -> float:
    """No assignment beats this max/mean: the longest sequence's cost, or a perfect split, whichever is more."""
    total = sum(cost(n) for n in lengths)
    return max(max(cost(n) for n in lengths), total / num_ranks) / (total / num_ranks)


def measure(groups: list[list[int]], cost: SequenceCost, num_batches: int, seed: int) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    out: dict[str, dict[str, float]] = {}
    batches = [[n for g in rng.choices(groups, k=GROUPS_PER_BATCH) for n in g] for _ in range(num_batches)]
    for num_ranks in RANKS:
        for name, assign in STRATEGIES.items():
            ratios = [imbalance(b, assign(b, num_ranks, cost), cost) for b in batches]
            out[f"{name}@{num_ranks}"] = {"mean": statistics.fmean(ratios), "max": max(ratios)}
        bounds = [lower_bound(b, num_ranks, cost) for b in batches]
        out[f"bound@{num_ranks}"] = {"mean": statistics.fmean(bounds), "max": max(bounds)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16, help="training tasks to run 8 episodes each of")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # episodes log a lot
    started = time.monotonic()
    load = os.getloadavg()[0]
    config = load_policy(PolicySection(device="cpu")).config
    cost = SequenceCost.for_model(config)
    real = default_run_groups(args.tasks, args.seed)
    lengths = sorted(n for g in real for n in g)
    dists = {"default_run": real, "long_tailed": long_tailed_groups(256, args.seed)}
    results = {name: measure(groups, cost, args.batches, args.seed) for name, groups in dists.items()}
    print(f"cost(n) = {cost.linear:.3g} n + {cost.quadratic:.3g} n^2 (the shipped policy; n^2 term = linear at "
          f"n = {cost.linear / cost.quadratic:.0f})")
    print(f"default run lengths: {len(lengths)} episodes, min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}")
    print("max/mean rank cost, mean (worst) over batches of 8 groups x 8 samples")
    for name, res in results.items():
        for num_ranks in RANKS:
            cells = "  ".join(f"{s} {res[f'{s}@{num_ranks}']['mean']:.3f} ({res[f'{s}@{num_ranks}']['max']:.3f})"
                              for s in (*STRATEGIES, "bound"))
            print(f"  {name:12s} {num_ranks} ranks: {cells}")
    print(json.dumps({"bench": "packing", "model": _describe(config), "load_avg_start": round(load, 2),
                      "default_run_lengths": {"num": len(lengths), "min": lengths[0], "max": lengths[-1],
                                              "median": lengths[len(lengths) // 2]},
                      "results": results, "wall_s": round(time.monotonic() - started, 1)}))


def _describe(config: ModelConfig) -> str:
    return (f"{config.num_hidden_layers}L d{config.hidden_size} {config.num_experts}x{config.num_experts_per_tok} "
            f"experts, {config.num_parameters() / 1e6:.1f}M params")


if __name__ == "__main__":
    main()
