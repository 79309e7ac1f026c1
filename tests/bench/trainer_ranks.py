"""Benchmark: one trainer step at 1 and 2 ranks (data parallel; and expert parallel), on this machine.

Each rank is its own process with one compute thread (``torch.set_num_threads(1)``, as
``actors.<kind>.threads = 1`` gives an actor), joined by gloo; the batch is the default run's size and
shape (8 groups x 8 samples of the default run's episode lengths, 186-374 tokens, median 195, as
``tests.bench.packing`` measured them; random tokens, the behaviour log-probs and router choices of the
shipped starting policy itself, so the step is on-policy). Per rank and step: wall time, CPU time of the
process (compute and gloo's threads; utilisation = CPU / wall), and the time spent inside collectives
(all-reduce, all-to-all, gathers: transfer plus waiting for the other rank), whose share of the step is
the communication share. tokens/s = the batch's tokens / the slowest rank's step.

    .venv/bin/python -m tests.bench.trainer_ranks                 # ~1-2 minutes on 2 cores
    .venv/bin/python -m tests.bench.trainer_ranks --steps 5
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.agent.policy import load_policy
from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.config import PolicySection, TrainerSection
from actors.records import GroupRecord, GroupSample, RewardBreakdown
from actors.stages.grouping import dr_grpo_advantages
from actors.training.learner import Learner
from actors.training.ranks import RankGroup, RankLayout
from model.packing import pack_sequences
from model.sampling import tempered_logprobs
from model.transformer import MoETransformer

LAYOUTS = ((1, 1), (2, 1), (2, 2))  # (ranks, expert parallel)
LENGTHS = (186, 374, 195)  # min, max, median of the default run's episodes (tests.bench.packing)
COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_object")


def batch(model: MoETransformer, seed: int) -> list[GroupRecord]:
    rng = random.Random(seed)
    lo, hi, median = LENGTHS
    groups = []
    for g in range(8):
        lens = [min(hi, max(lo, int(rng.lognormvariate(0.0, 0.15) * median))) for _ in range(8)]
        ids = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in lens]
        packed = pack_sequences(ids)
        with torch.no_grad():
            out = model(packed.input_ids_T, seq_lens=packed.seq_lens)
        logp = tempered_logprobs(out.logits, torch.ones(packed.num_tokens)).gather(1, packed.targets_T[:, None])[:, 0]
        rewards = [float(rng.random() < 0.5) for _ in lens]
        advantages = dr_grpo_advantages(rewards)
        samples, offset = [], 0
        for i, (seq, reward, adv) in enumerate(zip(ids, rewards, advantages, strict=True)):
            n, prompt = len(seq), 60
            traj = Trajectory([Segment(token_ids=seq, loss_mask=[0] * prompt + [1] * (n - prompt),
                                       behaviour_logprobs=[0.0, *logp[offset:offset + n - 1].tolist()],
                                       logprob_temperatures=[1.0] * n, versions=[-1] * prompt + [0] * (n - prompt),
                                       topk_ids_TLK=out.topk_ids_TLK[offset:offset + n].to(torch.int16).numpy(),
                                       prompt_len=prompt)], end=EpisodeEnd.FINAL_ANSWER)
            components = RewardBreakdown(reward, int(reward), 1, 0.0, 0.0, 0, 0.0, reward)
            samples.append(GroupSample(f"s{g}-{i}", reward, components, adv, traj))
            offset += n
        groups.append(GroupRecord(f"g{g}", f"p{g}", 0, 0, 0.0, tuple(samples)))
    return groups


class CollectiveClock:
    """Seconds spent inside torch.distributed collectives (patched for the bench's processes only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return wrapper


def rank_main(rank: int, world_size: int, expert_parallel: int, steps: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    clock = CollectiveClock()
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    model = load_policy(PolicySection(device="cpu"), training=True)
    groups = batch(model, seed=0)
    learner = Learner(copy.deepcopy(model), TrainerSection(), ranks=RankGroup(RankLayout(rank, world_size,
                                                                                           expert_parallel)))
    rows = []
    for step in range(steps + 1):  # the first is a warm-up
        comm0, cpu0, wall0 = clock.seconds, time.process_time(), time.perf_counter()
        m = learner.step(groups, f"b{step}")
        wall = time.perf_counter() - wall0
        if step:
            rows.append({"wall_s": wall, "cpu_s": time.process_time() - cpu0, "comm_s": clock.seconds - comm0,
                         "num_tokens": m.num_tokens})
    Path(out).write_text(json.dumps(rows))
    if world_size > 1:
        dist.destroy_process_group()


def run_layout(world_size: int, expert_parallel: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        outs = [f"{tmp}/rank{r}.json" for r in range(world_size)]
        mp.start_processes(_entry, args=(world_size, expert_parallel, steps, f"{tmp}/rdzv", tmp), nprocs=world_size,
                           join=True, start_method="spawn")
        per_rank = [json.loads(Path(o).read_text()) for o in outs]
    walls = [max(r[s]["wall_s"] for r in per_rank) for s in range(steps)]
    tokens = per_rank[0][0]["num_tokens"]
    return {
        "ranks": world_size, "expert_parallel": expert_parallel, "num_tokens": tokens,
        "tokens_per_s": tokens / statistics.median(walls), "step_s": statistics.median(walls),
        "utilisation": [round(sum(x["cpu_s"] for x in r) / sum(x["wall_s"] for x in r), 3) for r in per_rank],
        "comm_share": [round(sum(x["comm_s"] for x in r) / sum(x["wall_s"] for x in r), 3) for r in per_rank],
    }


def _entry(rank: int, world_size: int, expert_parallel: int, steps: int, rendezvous: str, tmp: str) -> None:
    rank_main(rank, world_size, expert_parallel, steps, rendezvous, f"{tmp}/rank{rank}.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per layout (after one warm-up)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    results = [run_layout(w, e, args.steps) for w, e in LAYOUTS]
    base = results[0]["tokens_per_s"]
    for r in results:
        r["speedup"] = round(r["tokens_per_s"] / base, 3)
        r["tokens_per_s"], r["step_s"] = round(r["tokens_per_s"], 1), round(r["step_s"], 3)
        print(f"{r['ranks']} rank(s), EP {r['expert_parallel']}: {r['tokens_per_s']} tokens/s ({r['speedup']}x), "
              f"step {r['step_s']} s, utilisation {r['utilisation']}, communication share {r['comm_share']}")
    print(json.dumps({"bench": "trainer_ranks", "cpus": os.cpu_count(), "load_avg_start": round(load_start, 2),
                      "load_avg_end": round(os.getloadavg()[0], 2), "results": results}))


if __name__ == "__main__":
    main()
