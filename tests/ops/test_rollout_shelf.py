"""The rollout viewer's sampled retention: the newest groups whole, a reservoir per version, bounded."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from ops.dashboard.model import RunView
from ops.dashboard.rollouts import RolloutShelf, ShelfLimits
from ops.dashboard.server import build_app


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
