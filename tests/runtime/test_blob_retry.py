"""One retry policy: each store retries its own transient errors, bounded by max_attempts in all;
nothing above it retries again (weight sync's Retry); non-transient errors are never retried."""

from __future__ import annotations

import errno
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from model.weight_sync.store import Retry
from runtime.blob import BlobUnavailable, FileBlobStore, open_store
from runtime.blob.testing import FaultProxy, MotoServer

pytestmark = pytest.mark.usefixtures("aws_env")  # moto and proxy come from tests/s3_fixtures.py


class FlakyDisk(FileBlobStore):
    """A file store whose writes fail with the given errnos first (a network file system's stale
    handle, a permission): the real store's retry decisions, the failure injected below them."""

    def __init__(self, root: Path, errnos: list[int]) -> None:
        from runtime.blob import BlobStoreConfig

        super().__init__(BlobStoreConfig(url=root.as_uri(), backoff_base_s=0.001, backoff_max_s=0.01))
        self.errnos, self.num_calls = errnos, 0

    def _put_sync(self, *args: Any) -> None:
        self.num_calls += 1
        if self.errnos:
            code = self.errnos.pop(0)
            raise OSError(code, errno.errorcode[code])
        super()._put_sync(*args)


async def test_file_store_retries_transient_errors_only(tmp_path: Path) -> None:
    store = FlakyDisk(tmp_path, [errno.ESTALE, errno.ETIMEDOUT])
    await store.put("a", b"1")  # two transient failures, then stored
    assert store.num_calls == 3 and await store.get("a") == b"1"
    for code in (errno.EACCES, errno.EROFS, errno.EIO):  # a full disk is waited out apart (test_blob_space)
        store = FlakyDisk(tmp_path, [code] * 10)
        with pytest.raises(OSError) as err:
            await store.put("b", b"2")
        assert err.value.errno == code and not isinstance(err.value, BlobUnavailable)
        assert store.num_calls == 1, f"{errno.errorcode[code]} was retried"
    store = FlakyDisk(tmp_path, [errno.ESTALE] * 10)
    with pytest.raises(BlobUnavailable, match="failed 5 times"):
        await store.put("c", b"3")
    assert store.num_calls == 5


async def test_weight_sync_never_retries_a_non_transient_error(tmp_path: Path) -> None:
    store = FlakyDisk(tmp_path, [errno.EACCES] * 10)
    with pytest.raises(OSError, match="EACCES"):
        await Retry(5, 0.001, 0.01).run("put", "k", lambda: store.put("k", b"x"))
    assert store.num_calls == 1


async def test_weight_sync_does_not_stack_retries_on_the_file_store(tmp_path: Path) -> None:
    store = FlakyDisk(tmp_path, [errno.ESTALE] * 100)
    with pytest.raises(BlobUnavailable):
        await Retry(5, 0.001, 0.01).run("put", "k", lambda: store.put("k", b"x"))
    assert store.num_calls == 5, "max_attempts in all, not 5 x 5"


async def test_weight_sync_does_not_stack_retries_on_s3(moto: MotoServer, proxy: FaultProxy) -> None:
    bucket = f"retry-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    proxy.clear()
    async with open_store(f"s3://{bucket}", s3_endpoint=proxy.endpoint, max_attempts=3,
                          backoff_base_s=0.001) as store:
        before = proxy.num_requests
        proxy.fail_next(100)  # 503 SlowDown on every request: the store retries it
        with pytest.raises(BlobUnavailable, match="failed 3 times"):
            await Retry(5, 0.001, 0.01).run("put", "k", lambda: store.put("k", b"x"))
        assert proxy.num_requests - before == 3, "max_attempts requests in all, not 3 x 5"
        proxy.clear()
        before = proxy.num_requests
        proxy.fail_next(2, status=429, code="TooManyRequests")  # a code botocore would not know: retried all the same
        await store.put("k", b"x")
        assert proxy.num_requests - before == 3
    proxy.clear()
