"""The trainer's ranks on GPUs: 2 processes, each on its own GPU, joined the way the trainer joins them there
(actors.trainer_group.init_process_group: ``cpu:gloo,cuda:nccl``, NCCL carrying gradients and the experts'
all-to-all, gloo the plans and objects), take the step one rank takes on one GPU: data parallel and expert
parallel, router replay on and off, within the bounds of tests/actors/training/test_ranks_equivalence.py.

Skipped unless this process sees 2 CUDA GPUs; written to run unchanged where they exist
(``python -m pytest tests/gpu``). It has not run where it was written (no GPU there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.trainer_group import init_process_group, rank_device
from actors.training.ranks import RankGroup, RankLayout
from tests.actors.training import rank_worker
from tests.actors.training.test_ranks_equivalence import assert_same_step

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the bounds are fp32's, as on the CPU
    torch.backends.cudnn.allow_tf32 = False


def nccl_rank_main(rank: int, world_size: int, expert_parallel: int, replay: bool, store_path: str,
                   out_dir: str) -> None:
    """One rank in its own process: the step on its GPU; rank 0 writes the full state, every rank what it saw."""
    _exact_fp32()
    layout = RankLayout(rank, world_size, expert_parallel)
    device = rank_device(torch.device("cuda"), rank)
    init_process_group(dist.FileStore(store_path, world_size), layout, device, timeout_s=300.0)
    try:
        state, metrics = rank_worker.step_once(layout, replay, device=device)
        plan = RankGroup(layout).broadcast_plan({"batch_id": "b1"} if rank == 0 else None)
        seen = {"backend": str(dist.get_backend()), "device": str(device), "plan": plan,
                "param_devices": sorted({str(t.device) for t in state.values()})}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
        if rank == 0:
            torch.save({"state": state, "metrics": metrics}, Path(out_dir, "state.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("expert_parallel", [1, 2], ids=["2dp", "2ep"])
def test_two_ranks_on_two_gpus_take_the_step_one_gpu_takes(tmp_path: Path, replay: bool, expert_parallel: int) -> None:
    _exact_fp32()
    one_state, one_metrics = rank_worker.step_once(RankLayout(), replay, device=torch.device("cuda", 0))
    mp.start_processes(nccl_rank_main, args=(2, expert_parallel, replay, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["device"] for s in seen] == ["cuda:0", "cuda:1"]  # each rank its own GPU, as NCCL needs
    assert all("nccl" in s["backend"] and "gloo" in s["backend"] for s in seen), seen
    assert all(s["plan"] == {"batch_id": "b1"} for s in seen)  # an object collective through gloo's side
    many = torch.load(tmp_path / "state.pt")
    assert_same_step(one_state, one_metrics, many["state"], many["metrics"])
