"""The trainer's group beyond the step: rank 0's plan reaches every rank, each rank reads only its share of
the batch's groups from storage and all end with all of them; every rank publishes a disjoint part of the
weights and the parts assemble into the whole model, with and without expert parallelism."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from actors.training.ranks import RankLayout, weights_to_publish
from model.checkpoint import checked_state
from model.expert_parallel import ExpertShard, shard_experts
from model.weight_sync.sharding import assemble
from tests.actors.training import rank_worker


def test_the_plan_reaches_every_rank_and_each_group_is_read_once(tmp_path: Path) -> None:
    rank_worker.launch(rank_worker.plan_main, (2, str(tmp_path / "rdzv"), str(tmp_path)), 2)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    keys = [f"groups/g{i}" for i in range(5)]
    for rank in out:
        assert rank["plan"] == {"batch_id": "b7", "keys": keys} and rank["stop"] is None
        assert rank["records"] == [f"record of {k}" for k in keys]
    assert out[0]["reads"] == keys[0::2] and out[1]["reads"] == keys[1::2]


@pytest.mark.parametrize(("world_size", "expert_parallel"), [(2, 1), (2, 2), (4, 2), (3, 1)])
def test_the_ranks_weight_parts_are_disjoint_and_make_the_whole_model(world_size: int, expert_parallel: int) -> None:
    full = rank_worker.starting_model()
    parts = []
    for rank in range(world_size):
        layout = RankLayout(rank, world_size, expert_parallel)
        model = copy.deepcopy(full)
        if expert_parallel > 1:  # building the shard needs no process group; only running it does
            shard_experts(model, ExpertShard(full.config.num_experts, expert_parallel, layout.expert_index))
        parts.append(weights_to_publish(model, layout))
    assert all(parts), "every rank publishes something"
    whole = checked_state(full, assemble(parts, version=1))  # assemble refuses a tensor named twice
    for name, tensor in full.state_dict().items():
        if name in whole:
            assert torch.equal(whole[name], tensor), name
    assert set(whole) == set(checked_state(full, full.state_dict()))
