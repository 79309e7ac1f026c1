"""One trainer rank in its own process, for the rank tests: a learner step on a fixed batch, then the full
updated parameters (expert shards gathered) and the step's metrics written by rank 0."""

from __future__ import annotations

import copy
import dataclasses
import json
import multiprocessing
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.config import TrainerSection
from actors.records import GroupRecord
from actors.training.learner import Learner
from actors.training.ranks import RankGroup, RankLayout, is_expert_param
from model.transformer import MoETransformer
from tests.actors.training.test_learner import _group
from tests.model.helpers import seeded_model, small_config

LR = 1e-3
REWARDS = ([1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0], [0.25, 0.25, 0.0, 1.0, 0.5], [1.0, 1.0, 1.0])


def launch(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank that raises fails the call. The ranks fork
    from one server that has imported torch and this module once, where a spawned rank would import them
    again (2.5 CPU-s a rank, most of a rank test's cost)."""
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def batch(model: MoETransformer) -> list[GroupRecord]:
    """Four groups of different sizes and lengths (one without signal), sampled by ``model``."""
    return [_group(model, list(r), seed=10 + i) for i, r in enumerate(REWARDS)]


def starting_model() -> MoETransformer:
    return seeded_model(small_config(), seed=1)


def full_state(learner: Learner) -> dict[str, torch.Tensor]:
    """Every parameter and its gradient (``<name>.grad``), expert shards gathered over the expert group."""
    layout = learner.ranks.layout
    out = {}
    for name, p in learner.model.named_parameters():
        for key, t in ((name, p.detach()), (f"{name}.grad", p.grad)):
            if t is None:  # not stepped yet (a learner just loaded)
                continue
            t = t.clone()
            if is_expert_param(name) and layout.expert_parallel > 1:
                parts = [torch.empty_like(t) for _ in range(layout.world_size)]
                dist.all_gather(parts, t.contiguous())
                t = torch.cat([parts[r] for r in layout.expert_group_ranks])
            out[key] = t
    return out


def step_once(layout: RankLayout, replay: bool, kl_coef: float = 0.0, device: torch.device | str = "cpu",
              micro_batch_tokens: int = 0, activation_checkpointing: bool = False
              ) -> tuple[dict[str, torch.Tensor], dict]:
    """One step of the rank ``layout`` on ``device``; the full state comes back on the CPU."""
    torch.manual_seed(0)
    model = starting_model()
    groups = batch(model)
    config = TrainerSection(lr=LR, router_replay=replay, kl_coef=kl_coef, micro_batch_tokens=micro_batch_tokens,
                            activation_checkpointing=activation_checkpointing)
    learner = Learner(copy.deepcopy(model).to(device), config, ranks=RankGroup(layout))
    metrics = learner.step(groups, "b0")
    return {k: t.cpu() for k, t in full_state(learner).items()}, dataclasses.asdict(metrics)


def main(rank: int, world_size: int, expert_parallel: int, replay: bool, kl_coef: float, rendezvous: str,
         out: str, micro_batch_tokens: int = 0, activation_checkpointing: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        state, metrics = step_once(RankLayout(rank, world_size, expert_parallel), replay, kl_coef,
                                   micro_batch_tokens=micro_batch_tokens,
                                   activation_checkpointing=activation_checkpointing)
        if rank == 0:
            torch.save({"state": state, "metrics": metrics}, Path(out))
    finally:
        dist.destroy_process_group()


def gathered_moments(learner: Learner) -> dict[str, torch.Tensor]:
    """Adam moments of every parameter (``<name>.exp_avg`` / ``.exp_avg_sq``), expert shards gathered."""
    layout = learner.ranks.layout
    names = {id(p): n for n, p in learner.model.named_parameters()}
    out = {}
    for p, state in learner.optimizer.state.items():
        name = names[id(p)]
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key].clone()
            if is_expert_param(name) and layout.expert_parallel > 1:
                parts = [torch.empty_like(t) for _ in range(layout.world_size)]
                dist.all_gather(parts, t.contiguous())
                t = torch.cat([parts[r] for r in layout.expert_group_ranks])
            out[f"{name}.{key}"] = t
    return out


def checkpoint_main(rank: int, world_size: int, expert_parallel: int, mode: str, checkpoints: str, rendezvous: str,
                    out: str) -> None:
    """``save``: one step, then a (sharded) checkpoint; ``load``: the newest checkpoint at this rank count.
    Rank 0 writes the whole state, moments, version and ledger after it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        ranks = RankGroup(RankLayout(rank, world_size, expert_parallel))
        config = TrainerSection(lr=LR)
        if mode == "save":
            model = starting_model()
            learner = Learner(copy.deepcopy(model), config, ranks=ranks)
            learner.step(batch(model), "b0")
            learner.save(Path(checkpoints))
        else:
            latest = Learner.latest_checkpoint(Path(checkpoints))
            assert latest is not None
            learner = Learner.load(latest, config, ranks=ranks)
        state = {k: v for k, v in full_state(learner).items() if not k.endswith(".grad")}
        moments = gathered_moments(learner)
        if rank == 0:
            torch.save({"state": state, "moments": moments, "version": learner.version,
                        "trained_groups": learner.trained_groups}, Path(out))
    finally:
        dist.destroy_process_group()


def plan_main(rank: int, world_size: int, rendezvous: str, out_dir: str) -> None:
    """Rank 0 broadcasts a plan naming 5 group keys; every rank reads its share and gets all 5 records;
    then rank 0 broadcasts the stop (None)."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        ranks = RankGroup(RankLayout(rank, world_size))
        plan = ranks.broadcast_plan({"batch_id": "b7", "keys": [f"groups/g{i}" for i in range(5)]} if rank == 0
                                    else None)
        reads: list[str] = []

        def read(key: str) -> str:
            reads.append(key)
            return f"record of {key}"

        assert plan is not None
        records = ranks.read_share(plan["keys"], read)
        stop = ranks.broadcast_plan(None)
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"plan": plan, "reads": reads, "records": records, "stop": stop}))
    finally:
        dist.destroy_process_group()


def edge_batch(model: MoETransformer, scenario: str) -> list[GroupRecord]:
    """One group of two samples with a signal, for more ranks than samples. ``nan-forward-<i>``:
    sample i's last trained token is scored at a temperature that is positive but divides its logits into
    inf (its forward is NaN); ``untrained-share``: sample 1 trains no token (the rank given it has none)."""
    group = _group(model, [1.0, 0.0], seed=2)
    if scenario.startswith("nan-forward-"):
        t = group.samples[int(scenario.rsplit("-", 1)[1])].trajectory.segments[0]
        t.logprob_temperatures[-1] = 1e-40
    elif scenario == "untrained-share":
        t = group.samples[1].trajectory.segments[0]
        t.loss_mask = [0] * len(t.loss_mask)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    return [group]


def edge_step(layout: RankLayout, scenario: str) -> dict:
    """One step of ``edge_batch`` as rank ``layout``: its metrics, its weights, whether they moved and
    whether Adam has moments."""
    torch.manual_seed(0)
    model = starting_model()
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=LR), ranks=RankGroup(layout))
    metrics = learner.step(edge_batch(model, scenario), "b0")
    moved = not all(torch.equal(p, q) for p, q in zip(model.parameters(), learner.model.parameters(), strict=True))
    return {"metrics": dataclasses.asdict(metrics), "moved": moved, "has_moments": bool(learner.optimizer.state),
            "state": {n: p.detach().clone() for n, p in learner.model.named_parameters()}}


def edge_main(rank: int, world_size: int, scenario: str, rendezvous: str, out_dir: str) -> None:
    """``edge_step`` on every rank of a gloo group; each rank writes what it got to ``rank<r>.pt``. A rank
    that raises ends its process (the test sees it), and a collective left unpaired fails within a minute."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(edge_step(RankLayout(rank, world_size), scenario), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
