"""BlobCollector on a real file:// store: finished groups' blobs go after the retention, nothing else does."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.blob_collector import BlobCollector
from actors.records import trainer_logprobs_key
from runtime.blob import open_store

GROUP_SIZE = 2


async def write_group(store, group_id: str, attempts: int = 1) -> list[str]:
    keys = [f"groups/{group_id}/a{a}" for a in range(1, attempts + 1)]
    for j in range(GROUP_SIZE):
        for a in range(1, attempts + 1):
            keys += [f"samples/{group_id}-s{j}/a{a}/trajectory", f"samples/{group_id}-s{j}/a{a}/reward"]
    for key in keys:
        await store.put(key, b"x")
    return keys


async def settle(collector: BlobCollector) -> None:
    await asyncio.wait_for(collector.wait_idle(), timeout=30)


async def test_finished_groups_are_collected_after_the_retention_and_live_ones_never(tmp_path: Path) -> None:
    live = {"e0-p2"}
    async with open_store(f"file://{tmp_path}") as store:
        await write_group(store, "e0-p0", attempts=2)  # a retried sample: both attempts' blobs go
        await write_group(store, "e0-p1")
        await write_group(store, "e0-p10")  # shares a prefix with e0-p1: must not go with it
        kept = await write_group(store, "e0-p2")
        await store.put("weights/run/v0000000001/manifest.json", b"w")
        await store.put("messages/RolloutOrder/abc", b"m")
        collector = BlobCollector(store, group_size=GROUP_SIZE, retention_versions=2, is_live=live.__contains__)
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(collector.run())
            collector.retire(["e0-p0", "e0-p1"], version=3)
            collector.advance(4)
            await settle(collector)
            assert len(await store.list("samples/e0-p0")) == 8, "kept until 2 versions past 3"
            collector.advance(5)
            await settle(collector)
            assert await store.list("groups/e0-p0/") == [] and await store.list("samples/e0-p0-") == []
            assert await store.list("samples/e0-p1-") == [] and await store.list("groups/e0-p1/") == []
            assert len(await store.list("samples/e0-p10-")) == 4, "another group's blobs untouched"
            assert collector.num_deleted == 10 + 5
            await store.put("samples/e0-p1-s0/a3/trajectory", b"late")  # a superseded attempt wrote after
            await collector.sweep(version=5)  # a restarted reconciler: what the table no longer holds
            collector.advance(7)
            await settle(collector)
            task.cancel()
        assert sorted(await store.list("")) == sorted([*kept, "messages/RolloutOrder/abc",
                                                       "weights/run/v0000000001/manifest.json"])
        assert not (tmp_path / "samples" / "e0-p0-s0").exists(), "emptied folders go too"


async def test_a_live_group_is_never_deleted(tmp_path: Path) -> None:
    async with open_store(f"file://{tmp_path}") as store:
        keys = await write_group(store, "e1-p0")
        collector = BlobCollector(store, group_size=GROUP_SIZE, retention_versions=0, is_live=lambda g: True)
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(collector.run())
            collector.retire(["e1-p0"], version=0)
            await collector.sweep(version=0)
            collector.advance(10)
            await settle(collector)
            task.cancel()
        assert sorted(await store.list("")) == sorted(keys)


async def test_the_trainers_log_probs_of_a_sample_go_with_its_group(tmp_path: Path) -> None:
    # stored for the rollout viewer beside the sample's blobs: bounded by the same retention, never kept forever
    async with open_store(f"file://{tmp_path}") as store:
        await write_group(store, "e0-p0")
        for j in range(GROUP_SIZE):
            await store.put(trainer_logprobs_key(f"e0-p0-s{j}"), b"t")
        collector = BlobCollector(store, group_size=GROUP_SIZE, retention_versions=1, is_live=lambda _: False)
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(collector.run())
            collector.retire(["e0-p0"], version=1)
            collector.advance(2)
            await settle(collector)
            task.cancel()
        assert await store.list("") == []
