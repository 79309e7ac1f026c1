"""Checkpoints of a trainer with ranks: every rank writes its shard (HF names, experts by global index), and
the checkpoint loads at another rank count with every weight and Adam moment exactly as saved: 2
expert-parallel ranks -> 1 rank and -> 2 data-parallel ranks, 1 rank -> 2 expert-parallel ranks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from actors.config import TrainerSection
from actors.training.learner import Learner
from actors.training.ranks import RankLayout, is_expert_param
from actors.training.sharded_checkpoint import read_shards, shard_tensors, write_shard
from model.errors import CheckpointError
from tests.actors.training import rank_worker


def _ranks(tmp_path: Path, world_size: int, expert_parallel: int, mode: str, checkpoints: Path) -> dict:
    tag = f"{mode}-{world_size}-{expert_parallel}"
    out = tmp_path / f"{tag}.pt"
    rank_worker.launch(rank_worker.checkpoint_main,
                       (world_size, expert_parallel, mode, str(checkpoints), str(tmp_path / f"rdzv-{tag}"), str(out)),
                       world_size)
    return torch.load(out)


def _single(learner: Learner) -> dict:
    names = {id(p): n for n, p in learner.model.named_parameters()}
    moments = {f"{names[id(p)]}.{k}": s[k] for p, s in learner.optimizer.state.items()
               for k in ("exp_avg", "exp_avg_sq")}
    return {"state": {n: p.detach() for n, p in learner.model.named_parameters()}, "moments": moments,
            "version": learner.version, "trained_groups": learner.trained_groups}


def _assert_same(got: dict, want: dict) -> None:
    assert got["version"] == want["version"] and got["trained_groups"] == want["trained_groups"]
    for part in ("state", "moments"):
        assert sorted(got[part]) == sorted(want[part]), part
        for name, tensor in want[part].items():
            assert torch.equal(got[part][name], tensor), (part, name)


def test_a_checkpoint_of_two_expert_parallel_ranks_loads_at_one_rank_and_at_two_data_parallel(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    saved = _ranks(tmp_path, 2, 2, "save", checkpoints)
    (step,) = [p for p in checkpoints.iterdir() if p.name.startswith("step-")]
    assert sorted(p.name for p in step.iterdir() if p.suffix == ".safetensors") == [
        "optimizer-rank-00000-of-00002.safetensors", "optimizer-rank-00001-of-00002.safetensors",
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert saved["version"] == 1 and saved["trained_groups"]
    _assert_same(_single(Learner.load(step, TrainerSection(lr=rank_worker.LR))), saved)
    _assert_same(_ranks(tmp_path, 2, 1, "load", checkpoints), saved)


def test_a_single_rank_checkpoint_loads_at_two_expert_parallel_ranks(tmp_path: Path) -> None:
    model = rank_worker.starting_model()
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=rank_worker.LR))
    learner.step(rank_worker.batch(model), "b0")
    learner.save(tmp_path / "ckpt")
    _assert_same(_ranks(tmp_path, 2, 2, "load", tmp_path / "ckpt"), _single(learner))


def _write_two_expert_shards(directory: Path) -> dict[str, torch.Tensor]:
    """A model's weights written as 2 expert-parallel ranks would (no process group needed to write)."""
    model = rank_worker.starting_model()
    full = dict(model.named_parameters())
    half = model.config.num_experts // 2
    for rank in (0, 1):
        mine = {n: (p[rank * half:(rank + 1) * half] if is_expert_param(n) else p) for n, p in full.items()}
        layout = RankLayout(rank, 2, 2)
        weights = shard_tensors(mine, layout, rank * half, model.config.tie_word_embeddings)
        write_shard(directory, layout, weights, shard_tensors(mine, layout, rank * half, False, suffix=".exp_avg"))
    return {n: p.detach() for n, p in full.items()}


def test_the_shards_put_together_are_the_whole_model_and_an_incomplete_set_is_refused(tmp_path: Path) -> None:
    full = _write_two_expert_shards(tmp_path)
    config = rank_worker.starting_model().config
    weights, moments = read_shards(tmp_path, config)
    assert weights.keys() == {n for n in full if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    for name, tensor in weights.items():
        assert torch.equal(tensor, full[name]), name
        assert torch.equal(moments[f"{name}.exp_avg"], full[name]), name
    (tmp_path / "rank-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="not one complete set"):
        read_shards(tmp_path, config)
