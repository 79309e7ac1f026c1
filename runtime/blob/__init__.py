"""Blob storage: one async interface over file:// (default) and s3:// (boto3).

    async with open_store("file:///runs/r1/blobs") as store:
        await store.put("weights/r1/v0000000001/manifest.json", data)
        data = await store.get("weights/r1/v0000000001/manifest.json")

Every backend gives atomic visibility (no reader sees a half-written object), sorted ``list``,
idempotent ``delete``, streaming of large objects (``put_stream`` / ``get_stream``; S3 multipart),
:class:`BlobNotFound` (a ``KeyError``) for missing keys and ``ValueError`` for unsafe keys. The
S3 backend retries transient errors with exponential backoff and raises :class:`BlobUnavailable`
(a ``ConnectionError``) once its attempts are spent; the file backend waits out a full disk, up to
``max_full_s``, then raises :class:`StorageFull` (a BlobUnavailable). ``runtime.blob.testing`` starts a real moto
S3 server and a fault-injecting proxy for tests. ``put_tree`` / ``get_tree`` store a directory as a
whole (its manifest written last).
"""

from __future__ import annotations

from typing import Any

from runtime.blob._base import (
    BlobError,
    BlobNotFound,
    BlobStore,
    BlobStoreConfig,
    BlobUnavailable,
    StreamSource,
    validate_key,
)
from runtime.blob._file import FileBlobStore
from runtime.blob._space import StorageFull
from runtime.blob._tree import MANIFEST, CorruptTree, delete_tree, get_tree, put_tree, tree_exists

__all__ = [
    "MANIFEST",
    "BlobError",
    "BlobNotFound",
    "BlobStore",
    "BlobStoreConfig",
    "BlobUnavailable",
    "CorruptTree",
    "FileBlobStore",
    "S3BlobStore",
    "StorageFull",
    "StreamSource",
    "delete_tree",
    "get_tree",
    "open_store",
    "put_tree",
    "store_from_config",
    "tree_exists",
    "validate_key",
]


def __getattr__(name: str) -> Any:
    if name == "S3BlobStore":
        from runtime.blob._s3 import S3BlobStore

        return S3BlobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def store_from_config(config: BlobStoreConfig) -> BlobStore:
    """The backend for ``config.url``'s scheme."""
    if config.url.startswith("s3://"):
        from runtime.blob._s3 import S3BlobStore  # boto3 (0.5 s to import) only where a store is in S3

        return S3BlobStore(config)
    return FileBlobStore(config)


def open_store(url: str, *, s3_endpoint: str | None = None, **options: Any) -> BlobStore:
    """Open the blob store at ``url`` (``file:///path`` or ``s3://bucket/prefix``).

    Args:
        url: where the objects live.
        s3_endpoint: endpoint URL of an S3-compatible service; None means AWS.
        **options: any other :class:`BlobStoreConfig` field (max_attempts, backoff_base_s, ...).

    Raises:
        ValueError: unknown scheme or invalid option value.
        TypeError: unknown option name.
    """
    return store_from_config(BlobStoreConfig(url=url, s3_endpoint=s3_endpoint, **options))
