"""The trainer's checkpoints in the blob store: saved by the learner, stored, pruned, and restored elsewhere."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from actors.config import TrainerSection
from actors.training.checkpoint_store import (
    download_checkpoint,
    prune_checkpoints,
    stored_checkpoints,
    upload_checkpoint,
)
from actors.training.learner import Learner
from runtime.blob import MANIFEST, open_store
from tests.actors.training.test_learner import _group
from tests.model.helpers import seeded_model, small_config


async def test_a_learner_stored_on_one_machine_resumes_on_another(tmp_path: Path) -> None:
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2)]
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    async with open_store((tmp_path / "shared").as_uri()) as store:
        for i in range(2):
            learner.step(groups, f"b{i}")
            await upload_checkpoint(store, learner.save(tmp_path / "machine-a"))
        assert await stored_checkpoints(store) == ["step-0000001", "step-0000002"]
        path = await download_checkpoint(store, "step-0000002", tmp_path / "machine-b" / "checkpoints")
    resumed = Learner.load(path, TrainerSection(lr=1e-3))
    assert resumed.version == 2 and resumed.trained_batches == ["b0", "b1"]
    assert resumed.trained_groups == learner.trained_groups
    for p, q in zip(resumed.model.parameters(), learner.model.parameters(), strict=True):
        assert torch.equal(p, q)
    a, b = resumed.step(groups, "b2"), learner.step(groups, "b2")
    assert a.loss == b.loss, "the optimizer's moments came along: the next step is the same"


async def test_pruning_keeps_the_newest_and_clears_an_unfinished_upload(tmp_path: Path) -> None:
    async with open_store((tmp_path / "blobs").as_uri()) as store:
        for step in (1, 2, 3, 4):
            d = tmp_path / f"step-{step:07d}"
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"w" * step)
            await upload_checkpoint(store, d)
        await store.delete(f"checkpoints/step-0000001/{MANIFEST}")  # killed before its manifest
        assert await prune_checkpoints(store, keep=2) == ["step-0000002"]
        assert await stored_checkpoints(store) == ["step-0000003", "step-0000004"]
        assert {k.split("/")[1] for k in await store.list("checkpoints/")} == {"step-0000003", "step-0000004"}
