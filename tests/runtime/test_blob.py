"""One storage suite, run against file:// and against s3:// on a real moto server over HTTP."""

from __future__ import annotations

import asyncio
import io
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import boto3
import pytest

from runtime.blob import (
    BlobError,
    BlobNotFound,
    BlobStore,
    BlobStoreConfig,
    BlobUnavailable,
    open_store,
)
from runtime.blob.testing import FaultProxy, MotoServer

MiB = 1024 * 1024
PART = 5 * MiB


pytestmark = pytest.mark.usefixtures("aws_env")  # moto and proxy come from tests/s3_fixtures.py


def _s3_client(moto: MotoServer):
    return boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1")


OPTIONS = {"multipart_part_bytes": PART, "multipart_threshold_bytes": PART, "backoff_base_s": 0.01}


def _open_s3(moto: MotoServer, proxy: FaultProxy) -> BlobStore:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    _s3_client(moto).create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/run", s3_endpoint=proxy.endpoint, **OPTIONS)


@pytest.fixture(params=["file", "s3"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, moto: MotoServer, proxy: FaultProxy
) -> AsyncIterator[BlobStore]:
    """The suite's subject: every test using it runs on both backends."""
    if request.param == "file":
        blob_store = open_store(f"file://{tmp_path}/blobs", **OPTIONS)
    else:
        blob_store = _open_s3(moto, proxy)
    proxy.clear()
    async with blob_store:
        yield blob_store
    proxy.clear()


@pytest.fixture
async def s3_store(moto: MotoServer, proxy: FaultProxy) -> AsyncIterator[BlobStore]:
    """S3 behind the fault-injecting proxy (faults sit between the client and moto's server)."""
    proxy.clear()
    async with _open_s3(moto, proxy) as blob_store:
        yield blob_store
    proxy.clear()


def _is_s3(store: BlobStore) -> bool:
    return store.url.startswith("s3://")


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def test_put_get_roundtrip_and_overwrite(store: BlobStore) -> None:
    payload = os.urandom(100_000)
    await store.put("a/b/c.bin", payload)
    assert await store.get("a/b/c.bin") == payload
    await store.put("a/b/c.bin", b"second")
    assert await store.get("a/b/c.bin") == b"second"
    await store.put("empty", b"")
    assert await store.get("empty") == b""
    assert await store.exists("empty")


async def test_missing_key_raises_blob_not_found(store: BlobStore) -> None:
    with pytest.raises(BlobNotFound, match="nope/x") as info:
        await store.get("nope/x")
    assert isinstance(info.value, KeyError)
    assert not await store.exists("nope/x")
    with pytest.raises(KeyError):
        async for _ in store.get_stream("nope/x"):
            pass


async def test_list_is_sorted_and_uses_string_prefixes(store: BlobStore) -> None:
    keys = ["w/v10/m.json", "w/v2/m.json", "w/v1/s0.bin", "w/v1/m.json", "w/v1x", "other/z", "top"]
    for key in keys:
        await store.put(key, key.encode())
    assert await store.list() == sorted(keys)
    assert await store.list("w/v1") == ["w/v1/m.json", "w/v1/s0.bin", "w/v10/m.json", "w/v1x"]
    assert await store.list("w/v1/") == ["w/v1/m.json", "w/v1/s0.bin"]
    assert await store.list("absent/") == []


async def test_delete_is_idempotent(store: BlobStore) -> None:
    await store.put("d/one", b"1")
    await store.put("d/two", b"2")
    await store.delete("d/one")
    await store.delete("d/one")
    assert await store.list("d/") == ["d/two"]
    with pytest.raises(BlobNotFound):
        await store.get("d/one")


async def test_delete_prefixes_removes_what_each_prefix_lists_and_nothing_else(store: BlobStore) -> None:
    keys = ["g/e0-p1/a0", "g/e0-p1/a1", "g/e0-p10/a0", "s/e0-p1-s0/a0/t", "s/e0-p1-s1/a2/t", "s/e0-p1-s10/a0/t"]
    for key in keys:
        await store.put(key, key.encode())
    num = await store.delete_prefixes(["g/e0-p1/", "s/e0-p1-s0/", "s/e0-p1-s1/", "s/absent/"])
    assert num == 4
    assert await store.list() == ["g/e0-p10/a0", "s/e0-p1-s10/a0/t"]
    assert await store.delete_prefixes(["g/e0-p1/"]) == 0  # idempotent, as delete is
    assert await store.delete_prefixes([]) == 0


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../escape", "a/../../b", "a//b", "a/./b", ".tmp/x", "a\\b"])
async def test_unsafe_keys_are_rejected_naming_the_key(store: BlobStore, key: str) -> None:
    for call in (
        store.put(key, b"x"),
        store.get(key),
        store.exists(key),
        store.delete(key),
        store.put_stream(key, _chunks(b"x", 1)),
    ):
        with pytest.raises(ValueError, match="blob key") as info:
            await call
        assert repr(key) in str(info.value)


async def test_streaming_large_object_from_iterator_and_file(store: BlobStore) -> None:
    payload = os.urandom(2 * PART + 12345)  # three multipart parts on S3
    assert await store.put_stream("big/iter", _chunks(payload, 1 * MiB + 7)) == len(payload)
    assert await store.put_stream("big/file", io.BytesIO(payload)) == len(payload)
    for key in ("big/iter", "big/file"):
        chunks = [chunk async for chunk in store.get_stream(key, chunk_bytes=3 * MiB)]
        assert b"".join(chunks) == payload
        assert max(len(chunk) for chunk in chunks) <= 3 * MiB
        assert len(chunks) == 4
    await store.put("big/whole", payload)  # put() above the threshold goes multipart on S3
    assert await store.get("big/whole") == payload


async def test_half_written_object_is_never_visible(store: BlobStore) -> None:
    old = b"old complete object"
    await store.put("obj", old)
    new = os.urandom(2 * PART)
    first_part_sent = asyncio.Event()
    release = asyncio.Event()

    async def gated() -> AsyncIterator[bytes]:
        yield new[: PART + 1]  # more than one S3 part: a part is really uploaded before the gate
        yield new[PART + 1 : PART + 2]
        first_part_sent.set()
        await release.wait()
        yield new[PART + 2 :]

    writers = [asyncio.create_task(store.put_stream(key, gated())) for key in ("obj", "fresh")]
    await first_part_sent.wait()
    await asyncio.sleep(0.3)
    assert await store.get("obj") == old
    assert b"".join([c async for c in store.get_stream("obj")]) == old
    assert not await store.exists("fresh")
    with pytest.raises(BlobNotFound):
        await store.get("fresh")
    assert await store.list() == ["obj"]
    release.set()
    await asyncio.gather(*writers)
    assert await store.get("obj") == new
    assert await store.get("fresh") == new


async def test_failed_stream_leaves_nothing_behind(store: BlobStore, moto: MotoServer) -> None:
    await store.put("keep", b"previous")

    async def broken() -> AsyncIterator[bytes]:
        yield os.urandom(PART + 100)
        raise RuntimeError("source died")

    for key in ("keep", "never"):
        with pytest.raises(RuntimeError, match="source died"):
            await store.put_stream(key, broken())
    assert await store.get("keep") == b"previous"
    assert await store.list() == ["keep"]
    if _is_s3(store):
        bucket = store.url.removeprefix("s3://").split("/")[0]
        assert "Uploads" not in _s3_client(moto).list_multipart_uploads(Bucket=bucket)
    else:
        assert list((Path(store.url.removeprefix("file://")) / ".tmp").iterdir()) == []


async def test_readers_racing_writers_see_whole_objects(store: BlobStore) -> None:
    versions = [bytes([i]) * (64 * 1024 + i) for i in range(8)]
    await store.put("race", versions[0])

    async def write_all() -> None:
        for payload in versions[1:]:
            await store.put("race", payload)

    async def read_many() -> set[bytes]:
        seen = set()
        for _ in range(20):
            seen.add(await store.get("race"))
        return seen

    _, *reads = await asyncio.gather(write_all(), read_many(), read_many())
    for seen in reads:
        assert seen <= set(versions)
    assert await store.get("race") == versions[-1]


async def test_transient_failures_are_retried(s3_store: BlobStore, proxy: FaultProxy) -> None:
    store = s3_store
    payload = os.urandom(PART + 10)
    proxy.fail_next(2)  # 503 SlowDown
    await store.put("t/a", b"a")
    proxy.fail_next(1, status=500, code="InternalError")
    proxy.reset_next(1)
    assert await store.get("t/a") == b"a"
    proxy.fail_next(1, status=503, code="ServiceUnavailable")
    proxy.reset_next(1)
    await store.put_stream("t/big", _chunks(payload, MiB))  # faults hit the multipart calls
    proxy.reset_next(2)
    assert await store.list("t/") == ["t/a", "t/big"]
    proxy.fail_next(2, status=429, code="TooManyRequests")
    assert b"".join([c async for c in store.get_stream("t/big", chunk_bytes=2 * MiB)]) == payload
    proxy.fail_next(1)
    await store.delete("t/a")
    assert not await store.exists("t/a")
    assert proxy.num_faults == 11  # every injected fault was consumed and survived


async def test_retries_are_bounded_and_permanent_errors_not_retried(s3_store: BlobStore, proxy: FaultProxy) -> None:
    store = s3_store
    attempts = store.config.max_attempts
    before = proxy.num_requests
    proxy.fail_next(attempts + 3)
    with pytest.raises(BlobUnavailable, match="failed 5 times") as info:
        await store.put("x", b"x")
    assert isinstance(info.value, ConnectionError)
    assert proxy.num_requests - before == attempts
    proxy.clear()
    before = proxy.num_requests
    proxy.fail_next(1, status=403, code="AccessDenied")
    with pytest.raises(Exception, match="AccessDenied"):
        await store.get("x")
    assert proxy.num_requests - before == 1


def test_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="ftp://x"):
        open_store("ftp://x")
    with pytest.raises(ValueError, match="max_attempts=0"):
        BlobStoreConfig(url="file:///tmp/x", max_attempts=0)
    with pytest.raises(ValueError, match="5 MiB"):
        BlobStoreConfig(url="s3://b", multipart_part_bytes=1024)
    with pytest.raises(ValueError, match="names no bucket"):
        open_store("s3:///prefix")
    with pytest.raises(TypeError):
        open_store("file:///tmp/x", no_such_option=1)


async def test_file_store_key_used_as_folder_is_a_clear_error(tmp_path: Path) -> None:
    async with open_store(f"file://{tmp_path}") as store:
        await store.put("a/b", b"1")
        with pytest.raises(BlobError, match="'a'"):
            await store.put("a", b"2")
        with pytest.raises(BlobNotFound):
            await store.get("a")
