"""file:// backend: one file per key under a root folder.

Atomic visibility: bytes go to a private temporary file under ``<root>/.tmp`` (same filesystem),
are fsynced, and are then renamed over the final path with ``os.replace``; the parent folder is
fsynced too, so a crash leaves either the old object, the new one, or nothing, never a torn file.
A reader that opened the old file keeps reading the old bytes.

Retries: a whole-object call that fails with an error a retry may get past (a stale NFS handle, a
timeout, EAGAIN: ``is_transient_os_error``) is tried up to ``max_attempts`` times, then raises
:class:`BlobUnavailable`. A full disk or quota is an outage: the write waits for space
(``runtime.blob._space``: said once, bounded by ``max_full_s``), a stream's chunk going on from where the
disk refused it. Any other error (a permission, a missing or read-only path) is raised at once, as it
is: retrying it only delays the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import structlog

from runtime.blob._base import (
    RESERVED_PREFIX,
    BlobError,
    BlobNotFound,
    BlobStore,
    BlobStoreConfig,
    BlobUnavailable,
    StreamSource,
    backoff_s,
    is_transient_os_error,
    iter_source,
    validate_key,
)
from runtime.blob._space import SpaceOutage, is_space_error

__all__ = ["FileBlobStore"]

log = structlog.get_logger(__name__)
T = TypeVar("T")
_WRITES = frozenset({"put"})  # a whole object stored ends a full-disk outage (a stream's at its end)


def root_from_url(url: str) -> Path:
    """``file:///abs/dir`` -> /abs/dir; ``file://rel/dir`` -> rel/dir resolved against the cwd."""
    path = url.removeprefix("file://")
    if not path:
        raise ValueError(f"blob url {url!r} names no folder; use file:///abs/path")
    return Path(path).resolve()


class FileBlobStore(BlobStore):
    """Blob store on a local (or shared POSIX) filesystem."""

    def __init__(self, config: BlobStoreConfig) -> None:
        super().__init__(config)
        self.root = root_from_url(config.url)
        self._tmp_dir = self.root / RESERVED_PREFIX
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        self._rng = random.Random()
        self.space = SpaceOutage(config, self.root)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def space_waited_s(self) -> float:
        return self.space.waited_s()

    # -- whole objects ---------------------------------------------------------------------------

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        path = self._path(key)
        await self._io("put", key, self._put_sync, key, path, [memoryview(data)])

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await self._io("get", key, path.read_bytes)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFound(key, self.url) from None

    async def exists(self, key: str) -> bool:
        path = self._path(key)
        return await self._io("exists", key, path.is_file)

    async def list(self, prefix: str = "") -> list[str]:
        return await self._io("list", prefix, self._list_sync, prefix)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        await self._io("delete", key, self._delete_sync, path)

    async def delete_prefixes(self, prefixes: Sequence[str]) -> int:
        """Every prefix listed and its files deleted in one thread hop (a hop costs more than listing a
        missing folder; the reconciler's blob collector deletes a few prefixes per group it retires)."""
        if not prefixes:
            return 0
        return await self._io("delete", prefixes[0], self._delete_prefixes_sync, list(prefixes))

    async def _io(self, op: str, key: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking file operation in a thread; transient errors retried, a full disk waited out
        (module docstring); one that waited for space and then succeeded ends the outage."""
        result, waited = await self._io_waiting(op, key, fn, *args)
        if waited or op in _WRITES:
            self.space.wrote(waited=waited)
        return result

    async def _io_waiting(self, op: str, key: str, fn: Callable[..., T], *args: Any) -> tuple[T, bool]:
        """`_io` without ending an outage: the result, and whether the operation waited for space (a
        stream's part that fits ends nothing: the disk may have room for a few of its bytes at a time, freed
        by other writers' failed tries, and the outage is over only once the whole object is stored)."""
        num_transient = num_full = 0
        try:
            while True:
                try:
                    result = await asyncio.to_thread(fn, *args)
                except OSError as exc:
                    if is_space_error(exc):  # an outage: its tries are bounded by time, not by max_attempts
                        num_full += 1
                        self.space.num_waiting += num_full == 1
                        await self.space.wait(op, key, exc, num_full)
                        continue
                    if not is_transient_os_error(exc):
                        raise
                    num_transient += 1
                    attempts = self.config.max_attempts
                    if num_transient == attempts:
                        raise BlobUnavailable(f"file {op} of {key!r} in {self.url} failed {attempts} times with "
                                              f"transient errors, last: {exc}; check the file system") from exc
                    delay_s = backoff_s(self.config, num_transient, self._rng)
                    log.warning("blob_retry", op=op, key=key, attempt=num_transient, delay_s=round(delay_s, 3),
                                error=str(exc))
                    await asyncio.sleep(delay_s)
                    continue
                waited = num_full > 0
                if num_full:
                    self.space.num_waiting -= 1
                    num_full = 0
                return result, waited
        finally:
            if num_full:  # gave up (StorageFull) or cancelled
                self.space.num_waiting -= 1

    # -- streams ---------------------------------------------------------------------------------

    async def put_stream(self, key: str, source: StreamSource) -> int:
        path = self._path(key)
        tmp = self._new_tmp_path()
        num_bytes = 0
        # unbuffered: a write the full disk cut short says how far it got, and goes on from there
        handle, waited = await self._io_waiting("put_stream", key, open, tmp, "wb", 0)
        try:
            async for chunk in iter_source(source, self.config.stream_chunk_bytes):
                rest = memoryview(chunk)
                while rest:
                    n, part_waited = await self._io_waiting("put_stream", key, handle.write, rest)
                    rest, waited = rest[n:], waited or part_waited
                num_bytes += len(chunk)
            await asyncio.to_thread(self._finish_tmp, handle)
            _, part_waited = await self._io_waiting("put_stream", key, self._publish_tmp, key, tmp, path)
            self.space.wrote(waited=waited or part_waited)  # the whole object stored: an outage it waited in ends
        except BaseException:
            handle.close()
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        log.debug("blob_put_stream", key=key, num_bytes=num_bytes, store=self.url)
        return num_bytes

    async def get_stream(self, key: str, chunk_bytes: int | None = None) -> AsyncIterator[bytes]:
        size = chunk_bytes or self.config.stream_chunk_bytes
        path = self._path(key)
        try:
            handle = await asyncio.to_thread(open, path, "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFound(key, self.url) from None
        try:
            while chunk := await asyncio.to_thread(handle.read, size):
                yield chunk
        finally:
            handle.close()

    # -- blocking helpers (run in threads) -------------------------------------------------------

    def _new_tmp_path(self) -> Path:
        return self._tmp_dir / f"{uuid.uuid4().hex}.part"

    def _put_sync(self, key: str, path: Path, chunks: list[memoryview]) -> None:
        tmp = self._new_tmp_path()
        try:
            with open(tmp, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                self._finish_tmp(handle)
            self._publish_tmp(key, tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise

    def _finish_tmp(self, handle: BinaryIO) -> None:
        handle.flush()
        if self.config.fsync:
            os.fsync(handle.fileno())
        handle.close()

    def _publish_tmp(self, key: str, tmp: Path, path: Path) -> None:
        # A concurrent delete may prune the parent folder between mkdir and replace: retry.
        for _ in range(8):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, path)
                break
            except FileNotFoundError:
                continue
            except IsADirectoryError:
                raise BlobError(f"cannot store blob {key!r}: other keys use it as a folder in {self.url}") from None
        else:
            raise BlobError(f"could not publish blob {key!r}: its folder kept disappearing")
        if self.config.fsync:
            self._fsync_dir(path.parent)

    @staticmethod
    def _fsync_dir(folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _walk(self, start: Path) -> Iterator[str]:
        for dirpath, dirnames, filenames in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).parts
            if rel[:1] == (RESERVED_PREFIX,):
                dirnames.clear()
                continue
            if not rel:
                dirnames[:] = [d for d in dirnames if d != RESERVED_PREFIX]
            for name in filenames:
                yield "/".join((*rel, name))

    def _list_sync(self, prefix: str) -> list[str]:
        folder = prefix.rpartition("/")[0]
        start = self.root.joinpath(*folder.split("/")) if folder else self.root
        if folder and ".." in folder.split("/"):
            raise ValueError(f"list prefix {prefix!r} may not contain '..' segments")
        if not start.is_dir():
            return []
        return sorted(key for key in self._walk(start) if key.startswith(prefix))

    def _delete_prefixes_sync(self, prefixes: list[str]) -> int:
        num_deleted = 0
        for prefix in prefixes:
            for key in self._list_sync(prefix):
                self._delete_sync(self._path(key))
                num_deleted += 1
        return num_deleted

    def _delete_sync(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except IsADirectoryError:
            return
        folder = path.parent
        while folder != self.root:
            try:
                folder.rmdir()
            except OSError:
                break
            folder = folder.parent
