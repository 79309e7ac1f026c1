"""A trainer whose weights publish keeps failing fails loudly: it exits non-zero naming the version and the
error, and the trainer its supervisor starts in its place publishes and announces that version."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from tests.integration.harness import LiveRun, run_events, write_config
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

RUN = """
[actors.trainer]
entry = "tests.integration.faulty_actors:PublishFailingTrainerActor"
max_concurrency = 1
[policy]
checkpoint = "{checkpoint}"
[tasks]
num_train = 8
num_heldout = 4
difficulties = [1]
"""


async def test_a_publish_that_keeps_failing_fails_the_trainer_and_its_replacement_publishes(tmp_path: Path) -> None:
    ckpt = tmp_path / "policy"
    save_checkpoint(MoETransformer(tiny()).init_weights(0), ckpt)
    run = await LiveRun(tmp_path / "run", write_config(tmp_path / "run.toml", RUN.format(checkpoint=ckpt))).start()
    try:
        (announced,) = await until(lambda: run_events(run.run_dir, "weights_announced"), 180,
                                   "version 0 announced", every_s=0.5)
        (failing,) = run_events(run.run_dir, "actor_failing")
        assert "publishing weights version 0 failed" in failing["reason"] and "no space left" in failing["reason"]
        (crashed,) = [e for e in run_events(run.run_dir, "actor_crashed") if e.get("actor_kind") == "trainer"]
        assert crashed["actor_id"] == failing["actor"] and crashed["returncode"] != 0
        assert announced["version"] == 0 and announced["actor"] != failing["actor"], "announced by the replacement"
    finally:
        assert await run.stop() == 0
