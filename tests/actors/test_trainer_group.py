"""The trainer group's backend and devices: gloo for a trainer on the CPU, gloo and NCCL in one group for one
on CUDA (CPU objects through gloo, CUDA tensors through NCCL), and each rank on its own GPU. The CUDA group
itself runs in tests/gpu/test_trainer_ranks_nccl.py (two GPUs); here torch's own parser reads the backend
string, and a real one-rank group forms on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from actors.trainer_group import init_process_group, process_group_backend, rank_device
from actors.training.ranks import RankGroup, RankLayout


def test_a_cpu_trainer_uses_gloo() -> None:
    assert process_group_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_trainer_uses_nccl_for_cuda_tensors_and_gloo_for_cpu_ones(spec: str) -> None:
    backend = process_group_backend(torch.device(spec))
    assert BackendConfig(backend).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def test_a_device_without_a_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no process group backend for device meta"):
        process_group_backend(torch.device("meta"))


def test_each_rank_takes_its_own_gpu_and_an_explicit_one_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_device(torch.device("cpu"), 3) == torch.device("cpu")
    assert rank_device(torch.device("cuda", 1), 0) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a host with two GPUs
    assert [rank_device(torch.device("cuda"), r) for r in range(4)] == [
        torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # under Ray: each rank sees only its own
    assert rank_device(torch.device("cuda"), 1) == torch.device("cuda", 0)


def test_a_rank_given_cuda_without_a_gpu_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        rank_device(torch.device("cuda"), 0)


def test_a_cpu_group_forms_on_gloo_and_carries_plans_and_flags() -> None:
    init_process_group(dist.HashStore(), RankLayout(0, 1), torch.device("cpu"), timeout_s=30.0)
    try:
        assert dist.get_backend() == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        box = [{"batch_id": "b1"}]
        dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
        assert box == [{"batch_id": "b1"}] and torch.equal(t, torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_one_rank_is_a_group_of_one_whose_collectives_are_identities() -> None:
    ranks = RankGroup(RankLayout())  # no process group: nothing to initialise for one rank
    assert not ranks.distributed and not dist.is_initialized()
    plan = {"batch_id": "b1"}
    assert ranks.broadcast_plan(plan) is plan and ranks.gather(True) == [True] and ranks.sum(2.5) == 2.5
    assert list(ranks.share_of(3)) == [0, 1, 2] and ranks.exchange({1: "b", 0: "a"}, 2) == ["a", "b"]
    assert ranks.any(True) and not ranks.any(False)
