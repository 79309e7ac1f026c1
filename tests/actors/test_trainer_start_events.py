"""What the trainer says about its weights at start (issue 30, item 8): the first publication of the starting policy
(version 0, at every fresh start) is routine, at info; publishing a checkpoint's version again (its process was killed
between the checkpoint and the manifest) stays a warning.

`TrainerActor._announce_current` alone, on an empty store, its collective and its upload stubbed (the whole start is
in tests/integration/test_stage_actors.py and test_trainer_kills.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from actors.config import RLConfig
from actors.stages.trainer import TrainerActor
from runtime.actor import ActorContext, ActorIdentity, ActorSettings
from runtime.blob import open_store


async def _start_events(tmp_path: Path, version: int, rank: int) -> list[dict[str, Any]]:
    async with open_store(f"file://{tmp_path}/blobs") as store:
        ctx = ActorContext(ActorIdentity.here("trainer", "trainer-1-ab", "h"), None, ActorSettings(),  # type: ignore[arg-type]
                           RLConfig(), blob=store)
        trainer = TrainerActor(ctx)
        trainer.run_name = "default"
        trainer.layout = SimpleNamespace(rank=rank)  # type: ignore[assignment]
        trainer.learner = SimpleNamespace(version=version)  # type: ignore[assignment]
        trainer.ranks = SimpleNamespace(distributed=False, broadcast_plan=lambda plan: plan)  # type: ignore[assignment]
        submitted: list[int] = []
        trainer._submit_weights = lambda: (submitted.append(version), None)  # type: ignore[method-assign]

        async def durable(_: Any) -> None:
            pass

        trainer._announce_when_durable = durable  # type: ignore[method-assign]
        with capture_logs() as logs:
            await trainer._announce_current()
        assert submitted == [version], "not in the store: published"
    return logs


@pytest.mark.parametrize("rank", [0, 1])
async def test_the_starting_policy_s_first_publication_is_info(tmp_path: Path, rank: int) -> None:
    logs = await _start_events(tmp_path, version=0, rank=rank)
    assert [(e["event"], e["log_level"]) for e in logs] == [("weights_publishing_starting_policy", "info")]


async def test_a_checkpoint_s_version_published_again_is_a_warning(tmp_path: Path) -> None:
    logs = await _start_events(tmp_path, version=4, rank=0)
    assert [(e["event"], e["log_level"]) for e in logs] == [("weights_republishing", "warning")]
