"""The rollout viewer's sampled retention: the newest groups whole, a reservoir per version, bounded."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import math
from pathlib import Path

import numpy
import zstandard
from aiohttp.test_utils import TestClient, TestServer

from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.records import (
    GroupRecord,
    GroupSample,
    RewardBreakdown,
    TrainerLogprobs,
    encode_record,
    trainer_logprobs_key,
)
from actors.sample_views import sample_views
from model.tokenizer import ByteTokenizer
from ops.dashboard.feeds import SampleFetcher
from ops.dashboard.model import RunView
from ops.dashboard.rollouts import RolloutShelf, ShelfLimits
from ops.dashboard.server import build_app
from runtime.blob import open_store


def _group(n: int, version: int, size: int = 2, reward: float = 0.5) -> list[dict]:
    return [{"sample_id": f"g{n}-s{i}", "group_id": f"g{n}", "prompt_id": f"p{n % 5}", "version": version,
             "reward": reward + i, "passed": i == 1, "tokens": [["a", version, 1, -0.1]]} for i in range(size)]


def test_retention_is_bounded_and_covers_every_version() -> None:
    shelf = RolloutShelf(ShelfLimits(keep_last=3, per_version=1, max_versions=8))
    for n in range(400):
        shelf.offer(_group(n, version=n // 4))  # 100 versions, 4 groups each
    assert shelf.num_groups <= 3 + 8 + 1, "the newest three, and at most a reservoir's worth"
    latest = [r["group_id"] for r in shelf.samples("latest")][::2]
    assert latest[:3] == ["g399", "g398", "g397"]
    kept_versions = {r["version"] for r in shelf.samples(limit=10_000)}
    assert min(kept_versions) < 30, "old versions stay represented (thinned), not only the newest"


def test_filters_sort_and_a_whole_sample_with_its_group() -> None:
    shelf = RolloutShelf()
    for n in range(6):
        shelf.offer(_group(n, version=n, reward=n / 10))
    assert all(r["prompt_id"] == "p1" for r in shelf.samples(prompt="p1"))
    assert all(not r["passed"] for r in shelf.samples(failed_only=True))
    rewards = [r["reward"] for r in shelf.samples("reward_high")]
    assert rewards == sorted(rewards, reverse=True)
    assert "tokens" not in shelf.samples()[0], "the list carries summaries, not tokens"
    whole = shelf.sample("g2-s1")
    assert whole is not None and whole["tokens"] == [["a", 2, 1, -0.1]]
    assert [m["sample_id"] for m in whole["group"]] == ["g2-s0", "g2-s1"]
    assert shelf.sample("nope") is None


async def test_the_viewer_endpoints() -> None:
    shelf = RolloutShelf()
    shelf.offer(_group(1, version=3))
    client = TestClient(TestServer(build_app(RunView("r"), shelf=shelf)))
    await client.start_server()
    try:
        listed = await (await client.get("/api/samples?sort=reward_low")).json()
        assert [s["sample_id"] for s in listed["samples"]] == ["g1-s0", "g1-s1"]
        assert (await client.get("/api/samples?sort=sideways")).status == 400
        assert (await (await client.get("/api/samples/g1-s1")).json())["version"] == 3
        assert (await client.get("/api/samples/missing")).status == 404
    finally:
        await client.close()


def test_a_later_record_amends_a_kept_sample_and_nothing_else() -> None:
    shelf = RolloutShelf(ShelfLimits(keep_last=1, per_version=0, max_versions=8))
    shelf.offer(_group(1, version=3))
    assert shelf.has("g1-s0") and not shelf.has("g1-s9")
    assert shelf.amend({"sample_id": "g1-s0", "group_id": "forged", "trainer_version": 3})
    whole = shelf.sample("g1-s0")
    assert whole is not None and whole["trainer_version"] == 3 and whole["group_id"] == "g1"
    assert "trainer_version" not in (shelf.sample("g1-s1") or {})
    assert not shelf.amend({"sample_id": "g9-s0", "trainer_version": 3}), "never offered: nothing to add to"
    shelf.offer(_group(2, version=4))  # keep_last=1 lets g1 go
    assert not shelf.has("g1-s0") and not shelf.amend({"sample_id": "g1-s0", "trainer_version": 3})


async def test_a_trained_samples_api_view_carries_the_trainers_log_probs(tmp_path: Path) -> None:
    # The real records, the real store and the real feed: a group is checkpointed (the viewer keeps it), its
    # samples are trained (the trainer's log-probs stored, the event names them): the sample's view gains them.
    tok = ByteTokenizer()
    segment = Segment(tok.encode("ab!"), [0, 1, 1], [0.0, -0.5, -1.0], [1.0] * 3, [-1, 2, 2], None, 1)
    components = RewardBreakdown(1.0, 1, 1, 0.0, 0.0, 0, 0.0, 1.0)
    samples = tuple(GroupSample(f"g1-s{i}", 1.0 - i, components, 0.5 - i,
                                Trajectory([segment], EpisodeEnd.FINAL_ANSWER)) for i in range(2))
    trainer = numpy.array([math.nan, -0.5, -1.25], dtype="<f4")

    def stored(record: object) -> bytes:
        return zstandard.ZstdCompressor().compress(encode_record(record))

    async with open_store(f"file://{tmp_path}") as blob:
        await blob.put("groups/g1/a1", stored(GroupRecord("g1", "p1", 2, 2, 0.0, samples)))
        await blob.put(trainer_logprobs_key("g1-s0"), stored(TrainerLogprobs("g1-s0", 2, (trainer.tobytes(),))))
        fetcher = SampleFetcher(blob, sample_views, RolloutShelf())
        client = TestClient(TestServer(build_app(RunView("r"), shelf=fetcher.shelf)))
        await client.start_server()
        run = asyncio.create_task(fetcher.run())
        try:
            fetcher.notice({"event": "group_checkpointed", "key": "groups/g1/a1"})
            await asyncio.wait_for(fetcher.wait_idle(), 10)
            before = await (await client.get("/api/samples/g1-s0")).json()
            assert "trainer_logprobs" not in before, "not trained yet: no trainer log-probs (and no error)"
            assert len(base64.b64decode(before["behaviour_logprobs"][0])) == 3 * 4
            fetcher.notice({"event": "trainer_logprobs_stored", "version": 2,
                            "keys": {"g1-s0": trainer_logprobs_key("g1-s0"), "g7-s0": trainer_logprobs_key("g7-s0")}})
            await asyncio.wait_for(fetcher.wait_idle(), 10)
            after = await (await client.get("/api/samples/g1-s0")).json()
            assert after["trainer_version"] == 2
            values = numpy.frombuffer(base64.b64decode(after["trainer_logprobs"][0]), dtype="<f4")
            assert numpy.array_equal(values[1:], trainer[1:]) and math.isnan(values[0])
            other = await (await client.get("/api/samples/g1-s1")).json()
            assert "trainer_logprobs" not in other, "its log-probs are its own"
            assert fetcher.num_unreadable == 0, "a sample the viewer does not keep (g7-s0) is not even read"
        finally:
            run.cancel()
            await client.close()


async def test_a_viewer_waiting_for_its_views_keeps_what_it_notices_within_its_bound_and_one_that_fails_stays_off(
        tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    ready = asyncio.Event()

    async def load(*, blob: object, bus: object, owner: str, waiting: object) -> object:
        waiting("the run's policy build p")  # type: ignore[operator]
        await ready.wait()
        return sample_views

    async def fail(**_: object) -> object:
        raise TimeoutError("the build p was not stored within 3600 s")

    segment = Segment(ByteTokenizer().encode("ab"), [0, 1], [0.0, -0.5], [1.0] * 2, [-1, 2], None, 1)
    sample = GroupSample("g-s0", 1.0, RewardBreakdown(1.0, 1, 1, 0.0, 0.0, 0, 0.0, 1.0), 0.5,
                         Trajectory([segment], EpisodeEnd.FINAL_ANSWER))
    async with open_store(f"file://{tmp_path}") as blob:
        for n in range(3):
            record = GroupRecord(f"g{n}", "p", 2, 2, 0.0, (dataclasses.replace(sample, sample_id=f"g{n}-s0"),))
            await blob.put(f"groups/g{n}/a0", zstandard.ZstdCompressor().compress(encode_record(record)))
        fetcher = SampleFetcher(blob, None, RolloutShelf(), max_pending=2, load=load)
        client = TestClient(TestServer(build_app(RunView("r"), shelf=fetcher.shelf)))
        await client.start_server()
        try:
            with capture_logs() as logs:
                async with asyncio.TaskGroup() as tg:
                    run = tg.create_task(fetcher.run())
                    for n in range(3):  # one more than the bound, while the views are not there yet
                        fetcher.notice({"event": "group_checkpointed", "key": f"groups/g{n}/a0"})
                    await asyncio.sleep(0)  # the fetcher starts, and says it waits
                    body = await (await client.get("/api/samples")).json()
                    assert body["samples"] == [] and "waiting for the run's policy build p" in body["note"]
                    assert fetcher.state == "waiting" and fetcher.num_skipped == 1
                    ready.set()
                    await asyncio.wait_for(fetcher.wait_idle(), 10)
                    run.cancel()
            body = await (await client.get("/api/samples")).json()
            assert sorted(s["sample_id"] for s in body["samples"]) == ["g0-s0", "g1-s0"] and "note" not in body
            assert [e["event"] for e in logs if e["event"].startswith("dashboard_viewer")] == [
                "dashboard_viewer_waiting", "dashboard_viewer_ready"]

            off = SampleFetcher(blob, None, RolloutShelf(), load=fail)
            with capture_logs() as logs:
                async with asyncio.TaskGroup() as tg:
                    run = tg.create_task(off.run())
                    off.notice({"event": "group_checkpointed", "key": "groups/g0/a0"})
                    await asyncio.wait_for(off.wait_idle(), 10)  # it goes on: skipping, not failing the dashboard
                    run.cancel()
            assert off.state == "failed" and off.num_skipped == 1 and "was not stored" in off.shelf.note
            (failed,) = [e for e in logs if e["event"] == "dashboard_viewer_failed"]
            assert failed["error_type"] == "TimeoutError" and failed["log_level"] == "error"
        finally:
            await client.close()
