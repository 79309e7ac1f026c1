"""A directory stored as a tree: whole or not at all, checked on the way back, on both backends."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import boto3
import pytest

from runtime.blob import MANIFEST, BlobStore, CorruptTree, delete_tree, get_tree, open_store, put_tree, tree_exists
from runtime.blob.testing import MotoServer

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture(params=["file", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    if request.param == "file":
        url, endpoint = (tmp_path / "blobs").as_uri(), None
    else:
        moto: MotoServer = request.getfixturevalue("moto")
        bucket = f"t-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        url, endpoint = f"s3://{bucket}/run", moto.endpoint
    async with open_store(url, s3_endpoint=endpoint) as s:
        yield s


def _tree(root: Path) -> Path:
    (root / "rank-0").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(os.urandom(3000))
    (root / "rank-0" / "shard.bin").write_bytes(b"x" * 10)
    (root / "state.json").write_text("{}")
    return root


def _contents(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


async def test_a_tree_comes_back_as_it_went(store: BlobStore, tmp_path: Path) -> None:
    source = _tree(tmp_path / "step-0000003")
    assert await put_tree(store, source, "checkpoints/step-0000003") == 3012
    assert await tree_exists(store, "checkpoints/step-0000003")
    back = await get_tree(store, "checkpoints/step-0000003", tmp_path / "cache" / "step-0000003")
    assert _contents(back) == _contents(source)
    assert not list((tmp_path / "cache").glob(".tmp-*")), "no temporary folder is left"


async def test_a_tree_without_its_manifest_does_not_exist(store: BlobStore, tmp_path: Path) -> None:
    """An upload killed before its manifest: the files are there, the tree is not."""
    source = _tree(tmp_path / "t")
    await put_tree(store, source, "trees/t")
    await store.delete(f"trees/t/{MANIFEST}")
    assert not await tree_exists(store, "trees/t")
    with pytest.raises(CorruptTree, match="no manifest"):
        await get_tree(store, "trees/t", tmp_path / "out")
    assert not (tmp_path / "out").exists()


async def test_a_file_that_differs_from_the_manifest_is_refused_and_nothing_replaces_the_cache(
        store: BlobStore, tmp_path: Path) -> None:
    source = _tree(tmp_path / "t")
    await put_tree(store, source, "trees/t")
    cached = await get_tree(store, "trees/t", tmp_path / "cache" / "t")
    await store.put("trees/t/rank-0/shard.bin", b"y" * 10)  # same size, other bytes
    (cached / "state.json").write_text("{1}")  # and the cache no longer matches either
    with pytest.raises(CorruptTree, match="differs from its manifest"):
        await get_tree(store, "trees/t", cached)
    assert (cached / "state.json").read_text() == "{1}", "a refused download leaves the destination as it was"
    await store.put("trees/t/rank-0/shard.bin", b"x" * 10)
    await store.delete("trees/t/state.json")
    with pytest.raises(CorruptTree, match="lacks"):
        await get_tree(store, "trees/t", tmp_path / "other")


async def test_a_matching_cache_is_used_as_it_is(store: BlobStore, tmp_path: Path) -> None:
    source = _tree(tmp_path / "t")
    await put_tree(store, source, "trees/t")
    cached = await get_tree(store, "trees/t", tmp_path / "cache" / "t")
    before = (cached / "model.safetensors").stat().st_ino
    assert await get_tree(store, "trees/t", cached) == cached
    assert (cached / "model.safetensors").stat().st_ino == before


async def test_delete_removes_the_manifest_and_every_file(store: BlobStore, tmp_path: Path) -> None:
    await put_tree(store, _tree(tmp_path / "t"), "trees/t")
    await put_tree(store, _tree(tmp_path / "t2"), "trees/t2")
    await delete_tree(store, "trees/t")
    assert await store.list("trees/t/") == []
    assert await tree_exists(store, "trees/t2")
