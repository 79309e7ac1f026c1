"""A full disk under the file store is an outage the writes wait out: said once (``storage_full`` with the
path and free space), the write done by itself once space returns (``storage_recovered``), bounded by
``max_full_s`` (then StorageFull, naming the store, the bound and what to do). On a real tmpfs filled to
the last byte, and, for the bound and the errno classes, with ENOSPC/EDQUOT injected below the store."""

from __future__ import annotations

import asyncio
import errno
import io
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from runtime.blob import BlobStoreConfig, FileBlobStore, StorageFull, get_tree, put_tree
from tests.small_disk import FullDisk, fill, small_tmpfs
from tests.waiting import until

MiB = 1024 * 1024


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
async def test_a_full_disk_or_quota_is_waited_out_and_said_once(tmp_path: Path, code: int) -> None:
    store = FullDisk(tmp_path, [code] * 4)
    with capture_logs() as logs:
        await asyncio.gather(store.put("a", b"1"), store.put("b", b"2"))  # two writers meet one outage
    assert await store.get("a") == b"1" and await store.get("b") == b"2"
    (full,) = _events(logs, "storage_full")
    assert full["path"] == str(tmp_path) and full["free_bytes"] > 0 and full["max_full_s"] == 5.0
    assert len(_events(logs, "storage_recovered")) == 1
    assert store.space.full_since is None and store.space.num_outages == 1


async def test_a_small_write_that_fits_while_a_large_one_waits_ends_no_outage(tmp_path: Path) -> None:
    class LargeWritesFail(FullDisk):
        def _put_sync(self, key: str, path: Path, chunks: list[memoryview]) -> None:
            if key == "large" and self.errnos:
                self.errnos.pop(0)
                raise OSError(errno.ENOSPC, "No space left on device")
            FileBlobStore._put_sync(self, key, path, chunks)

    store = LargeWritesFail(tmp_path, [errno.ENOSPC] * 30)
    with capture_logs() as logs:
        large = asyncio.ensure_future(store.put("large", b"L" * 1000))
        await until(lambda: store.space.num_waiting == 1, 5, "the large write to wait")
        for i in range(5):
            await store.put(f"small-{i}", b"s")
        assert not _events(logs, "storage_recovered") and store.space.full_since is not None
        await large
    assert len(_events(logs, "storage_full")) == 1 and len(_events(logs, "storage_recovered")) == 1
    assert store.space.num_waiting == 0 and store.space.full_since is None


async def test_a_stream_that_gets_a_few_bytes_in_at_a_time_ends_its_outage_only_once_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full disk other writers' failed tries free their pages again and again, so a waiting stream's
    write now and then gets a few bytes in and meets the full disk again: one outage (said once), over only
    once the whole object is stored. Each such part ended it, so a trainer's checkpoint said storage_full
    and storage_recovered over and over (test_storage_full: storage_full twice in the trainer)."""
    import runtime.blob._file as file_module

    class Trickle:
        """The disk refuses a write, then takes 100 bytes of it, three times; then it has room."""

        def __init__(self, handle: Any) -> None:
            self.handle, self.script = handle, ["full", 100, "full", 100, "full", 100]

        def write(self, data: memoryview) -> int:
            step = self.script.pop(0) if self.script else None
            if step == "full":
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.handle.write(data[:step] if step else data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

    monkeypatch.setattr(file_module, "open", lambda *a: Trickle(open(*a)), raising=False)  # noqa: SIM115
    store = FileBlobStore(BlobStoreConfig(url=tmp_path.as_uri(), backoff_base_s=0.001, backoff_max_s=0.01))
    payload = bytes(range(256)) * 64
    with capture_logs() as logs:
        await store.put_stream("stream", io.BytesIO(payload))
    assert await store.get("stream") == payload
    assert len(_events(logs, "storage_full")) == 1 and len(_events(logs, "storage_recovered")) == 1
    assert store.space.num_outages == 1 and store.space.full_since is None and store.space.num_waiting == 0


async def test_a_disk_full_for_longer_than_max_full_s_fails_the_write_saying_what_to_do(tmp_path: Path) -> None:
    store = FullDisk(tmp_path, [errno.ENOSPC] * 10_000, max_full_s=0.3)
    started = time.monotonic()
    with pytest.raises(StorageFull, match=r"full for 0s \(blob max_full_s=0.3.*Free space there or grow it"):
        await store.put("a", b"1")
    assert store.space.num_waiting == 0, "a write that gave up waits no more"
    assert 0.3 <= time.monotonic() - started < 2.0
    assert isinstance(StorageFull("x"), OSError), "callers that handle an unavailable store handle it too"


async def test_an_outage_past_1024_tries_is_still_waited_out(tmp_path: Path) -> None:
    """The tries of a full disk are bounded by time, not by a count: with short retry delays (or an outage of
    an hour at 5 s) the 1025th try's backoff raised OverflowError (base * 2 ** 1024) instead of waiting."""
    store = FullDisk(tmp_path, [errno.ENOSPC] * 1100, max_full_s=600.0, backoff_max_s=0.0)
    with capture_logs() as logs:
        await store.put("a", b"1")
    assert await store.get("a") == b"1" and store.num_calls == 1101
    assert len(_events(logs, "storage_full")) == 1 and len(_events(logs, "storage_recovered")) == 1


async def test_a_write_waits_on_a_real_full_tmpfs_and_is_done_once_space_returns(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", 4 * MiB) as root:
        store = FileBlobStore(BlobStoreConfig(url=root.as_uri(), backoff_max_s=0.5, max_full_s=60.0))
        await store.put("before", b"x" * 1000)
        filler = fill(root)
        payload = bytes(range(256)) * 4096  # 1 MiB
        source = tmp_path / "tree"
        source.mkdir()
        (source / "weights.bin").write_bytes(payload * 2)  # streamed in chunks (put_tree)
        with capture_logs() as logs:
            put = asyncio.ensure_future(store.put("whole", payload))
            tree = asyncio.ensure_future(put_tree(store, source, "trees/t"))
            await until(lambda: len(_events(logs, "storage_full")) == 1 and store.space.full_since, 10,
                        "the store to say its disk is full")
            await asyncio.sleep(0.5)  # they keep waiting while it stays full: none fails
            assert not put.done() and not tree.done()
            freed = time.monotonic()
            filler.unlink()
            await asyncio.wait_for(asyncio.gather(put, tree), 10)
            recovered_s = time.monotonic() - freed
        assert await store.get("whole") == payload
        assert (await get_tree(store, "trees/t", tmp_path / "back") / "weights.bin").read_bytes() == payload * 2
        assert len(_events(logs, "storage_full")) == 1 and len(_events(logs, "storage_recovered")) == 1
        assert recovered_s < 2.0, f"the writes took {recovered_s:.1f}s after the space returned"
        assert not list((root / ".tmp").iterdir()), "no half-written object left behind"
