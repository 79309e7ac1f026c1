"""The blob-store contract: configuration, errors, key rules and the abstract async interface.

Keys are '/'-separated relative paths (``weights/run-1/v0000000003/manifest.json``). Every backend
gives the same guarantees: a reader sees either the whole object or nothing (atomic visibility),
``list`` returns keys in sorted order, ``delete`` is idempotent, and a missing key raises
:class:`BlobNotFound` (a ``KeyError``).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import errno
import random
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import BinaryIO, Literal, Self

from runtime.backoff import doubling

__all__ = [
    "RESERVED_PREFIX",
    "BlobError",
    "BlobNotFound",
    "BlobStore",
    "BlobStoreConfig",
    "BlobUnavailable",
    "StreamSource",
    "backoff_s",
    "is_transient_os_error",
    "iter_source",
    "validate_key",
]

MiB = 1024 * 1024
RESERVED_PREFIX = ".tmp"
"""First key segment reserved by the file backend for half-written objects."""

StreamSource = AsyncIterable[bytes] | BinaryIO


class BlobError(Exception):
    """Base class of every blob-store error."""


class BlobNotFound(BlobError, KeyError):
    """The key names no object in the store."""

    def __init__(self, key: str, where: str) -> None:
        super().__init__(key)
        self.key = key
        self.where = where

    def __str__(self) -> str:
        return f"blob {self.key!r} not found in {self.where}"


class BlobUnavailable(BlobError, ConnectionError):
    """The store kept failing with transient errors after every allowed attempt."""

    retried = True  # the store's own retry policy is spent: a caller above must not retry it again


TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ESTALE, errno.ETIMEDOUT,
                              errno.ECONNRESET, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})
"""Errors of a file system (a network one, mostly) that a retry may get past. A full disk or quota is an
outage waited out apart (runtime.blob._space); anything else (a permission, a missing or read-only
path, an I/O error of the disk) is raised at once."""


def is_transient_os_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def backoff_s(config: BlobStoreConfig, attempt: int, rng: random.Random) -> float:
    """The delay before retry number ``attempt``: capped exponential with full jitter over its top half."""
    cap = doubling(config.backoff_base_s, config.backoff_max_s, attempt - 1)
    return cap / 2 + rng.uniform(0, cap / 2)


@dataclasses.dataclass(frozen=True)
class BlobStoreConfig:
    """Where the store lives and how it talks to it.

    Args:
        url: ``file:///abs/path`` (or ``file://relative/path``) or ``s3://bucket[/prefix]``.
        s3_endpoint: endpoint URL of an S3-compatible service (None: AWS from boto3's defaults).
        s3_region: region name given to boto3.
        s3_addressing_style: "auto" means path style when an endpoint is given, else boto3's choice.
        max_attempts: attempts per S3 request before :class:`BlobUnavailable` (1 = no retry).
        backoff_base_s: first retry delay; each later retry doubles it (full jitter).
        backoff_max_s: cap of one retry delay.
        connect_timeout_s: S3 connect timeout.
        read_timeout_s: S3 read timeout.
        multipart_threshold_bytes: objects at least this large go up to S3 in parts.
        multipart_part_bytes: size of one multipart part (S3 needs >= 5 MiB except the last).
        stream_chunk_bytes: chunk size ``get_stream`` yields by default.
        max_pool_connections: concurrent HTTP connections of the S3 client.
        fsync: the file backend fsyncs data and directories before an object becomes visible.
        max_full_s: the file backend waits this long for space when its file system is full (a write
            is retried, runtime.blob._space), then raises StorageFull.
    """

    url: str
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    max_attempts: int = 5
    backoff_base_s: float = 0.1
    backoff_max_s: float = 5.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    multipart_threshold_bytes: int = 64 * MiB
    multipart_part_bytes: int = 16 * MiB
    stream_chunk_bytes: int = 4 * MiB
    max_pool_connections: int = 16
    fsync: bool = True
    max_full_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("file://", "s3://")):
            raise ValueError(f"blob url {self.url!r} has an unknown scheme; use file:///path or s3://bucket/prefix")
        if self.s3_addressing_style not in ("auto", "path", "virtual"):
            raise ValueError(f"s3_addressing_style={self.s3_addressing_style!r}; use 'auto', 'path' or 'virtual'")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1 (1 disables retries)")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError(
                f"backoff_base_s={self.backoff_base_s}, backoff_max_s={self.backoff_max_s}: "
                "need 0 <= backoff_base_s <= backoff_max_s"
            )
        if self.multipart_part_bytes < 5 * MiB:
            raise ValueError(f"multipart_part_bytes={self.multipart_part_bytes} is below S3's 5 MiB part minimum")
        if self.multipart_threshold_bytes < self.multipart_part_bytes:
            raise ValueError(
                f"multipart_threshold_bytes={self.multipart_threshold_bytes} must be >= "
                f"multipart_part_bytes={self.multipart_part_bytes}"
            )
        for name in ("stream_chunk_bytes", "max_pool_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_full_s < 0:
            raise ValueError(f"max_full_s={self.max_full_s} must be >= 0 (0: a full disk fails the write at once)")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError(
                f"connect_timeout_s={self.connect_timeout_s}, read_timeout_s={self.read_timeout_s}: "
                "timeouts must be > 0"
            )


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ValueError naming it.

    Raises:
        ValueError: empty key, absolute path, backslash or NUL, an empty, '.' or '..' segment,
            or the reserved first segment ``.tmp``.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"blob key {key!r} must be a non-empty string")
    if key.startswith("/"):
        raise ValueError(f"blob key {key!r} is absolute; keys are relative like 'runs/a/b.bin'")
    if "\\" in key or "\x00" in key:
        raise ValueError(f"blob key {key!r} contains a backslash or NUL; use '/' separators only")
    segments = key.split("/")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise ValueError(f"blob key {key!r} has an empty, '.' or '..' segment; keys may not escape the store")
    if segments[0] == RESERVED_PREFIX:
        raise ValueError(f"blob key {key!r} starts with the reserved segment {RESERVED_PREFIX!r}")
    return key


class BlobStore(abc.ABC):
    """Async blob store. Use as ``async with open_store(url) as store: ...``."""

    def __init__(self, config: BlobStoreConfig) -> None:
        self.config = config

    @property
    def url(self) -> str:
        return self.config.url

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` (replacing any object there), visible all at once."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """Return the object's bytes. Raises BlobNotFound."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether a complete object is stored under ``key``."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix`` (a plain string prefix, not a folder)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    async def delete_prefixes(self, prefixes: Sequence[str]) -> int:
        """Remove every object whose key starts with one of ``prefixes``; returns how many were removed.
        Each prefix is listed and its objects deleted in turn; a backend may do it all in one call."""
        num_deleted = 0
        for prefix in prefixes:
            for key in await self.list(prefix):
                await self.delete(key)
                num_deleted += 1
        return num_deleted

    @abc.abstractmethod
    async def put_stream(self, key: str, source: StreamSource) -> int:
        """Store the bytes of an async iterator or binary file object; returns the byte count.

        The object becomes visible only once the source is exhausted and every byte is stored;
        if the source raises, nothing becomes visible.
        """

    @abc.abstractmethod
    def get_stream(self, key: str, chunk_bytes: int | None = None) -> AsyncIterator[bytes]:
        """Yield the object's bytes in chunks. Raises BlobNotFound on the first iteration."""

    async def close(self) -> None:  # noqa: B027 - backends without resources keep the default
        """Release resources; idempotent."""

    def space_waited_s(self) -> float:
        """Seconds writes have spent waiting out a full file system so far (runtime.blob._space), counted
        once however many waited together; 0 for a backend that never waits for space."""
        return 0.0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.url!r})"


async def iter_source(source: StreamSource, chunk_bytes: int) -> AsyncIterator[bytes]:
    """Chunks of a put_stream source: an async iterable of bytes, or a binary file read in a thread."""
    if hasattr(source, "__aiter__"):
        async for chunk in source:  # type: ignore[union-attr]
            if not isinstance(chunk, bytes | bytearray | memoryview):
                raise TypeError(f"put_stream source yielded {type(chunk).__name__}; expected bytes")
            if chunk:
                yield bytes(chunk)
        return
    if not hasattr(source, "read"):
        raise TypeError(
            f"put_stream source {type(source).__name__} is neither an async iterable of bytes nor a binary file object"
        )
    while True:
        chunk = await asyncio.to_thread(source.read, chunk_bytes)  # type: ignore[union-attr]
        if not chunk:
            return
        yield bytes(chunk)
