"""The trainer as two ranks in the default run: they meet through the bus, train every batch together
(data parallel, gloo), write sharded checkpoints and publish one weight part each, which the rollout
actor assembles; rank 1 killed with -9 after the second step breaks the group, both ranks restart
together at the next rendezvous generation, resume from the newest checkpoint, and the run goes on:
every version is trained once, no group twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from runtime.metrics_log import read_run_metrics
from tests.integration.harness import LiveRun, run_events
from tests.waiting import until

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"ASYNCRL_RANK=")]
    return ranks[0] if ranks else None


async def _train_rows(run_dir: Path) -> list[dict]:
    return await read_run_metrics(run_dir, kind="train")


async def _at_least(run_dir: Path, steps: int) -> bool:
    return len(await _train_rows(run_dir)) >= steps


@pytest.mark.slow
def test_two_trainer_ranks_train_restart_together_after_a_kill_and_train_nothing_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    live = LiveRun(run_dir, REPO / "actors" / "run.toml", "--steps", str(STEPS),
                   "--set", "actors.trainer.ranks=2", "--set", "actors.evaluator.count=0",
                   "--set", "actors.dashboard.count=0", "--set", "bus.ack_wait_s=5.0")

    async def scenario() -> None:
        await live.start()
        try:
            await until(lambda: _at_least(run_dir, 2), 400, "two steps of the group")
            trainers = [a for a in await live.actors() if a["kind"] == "trainer"]
            assert sorted(_rank_of(a["pid"]) for a in trainers) == [0, 1]
            (rank1,) = [a for a in trainers if _rank_of(a["pid"]) == 1]
            os.kill(rank1["pid"], signal.SIGKILL)
            await until(lambda: _at_least(run_dir, STEPS), 600, f"{STEPS} steps after the kill")
        finally:
            await live.stop(timeout_s=120)

    asyncio.run(scenario())
    rows = asyncio.run(_train_rows(run_dir))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))  # each version trained and reported once
    groups = [g for r in rows for g in r["group_ids"]]
    assert len(groups) == len(set(groups)), "a group was trained twice"
    formed = run_events(run_dir, "trainer_group_formed")
    assert {e["generation"] for e in formed} >= {1, 2}, "the group did not restart at a new generation"
    assert run_events(run_dir, "trainer_group_marked_broken") or run_events(run_dir, "actor_failing")
    newest = max((run_dir / "checkpoints").glob("step-*"))
    assert sorted(p.name for p in newest.glob("rank-*")) == ["rank-00000-of-00002.safetensors",
                                                             "rank-00001-of-00002.safetensors"]
    fetched = [e for e in run_events(run_dir, "weights_fetched") if e.get("kind") == "rollout"]
    assert fetched and all(e["world_size"] == 2 for e in fetched)
