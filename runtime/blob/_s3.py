"""s3:// backend on boto3, run in worker threads so the event loop never blocks.

One retry policy, bounded by ``max_attempts`` attempts in all: :meth:`S3BlobStore._call` retries every
transient failure of a request (throttling, HTTP 429 and 5xx, connection errors, a response body cut
short while it is read) with the store's own backoff (``backoff_base_s`` doubling up to ``backoff_max_s``,
jittered), and botocore retries nothing (its standard mode would sleep its own backoff, 1 s doubling to
20 s, which no setting of the store could shorten). After ``max_attempts`` attempts it raises
:class:`BlobUnavailable` (marked ``retried``: callers above must not retry again). Non-transient errors
(access denied, missing bucket) are never retried.
S3 makes single PUTs and completed multipart uploads visible atomically; an aborted or unfinished
multipart upload is never visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import structlog
import urllib3.exceptions

from runtime.blob._base import (
    BlobError,
    BlobNotFound,
    BlobStore,
    BlobStoreConfig,
    BlobUnavailable,
    StreamSource,
    backoff_s,
    iter_source,
    validate_key,
)

__all__ = ["S3BlobStore", "is_transient"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_TRANSIENT_BOTOCORE = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.IncompleteReadError,
)


class BodyCutShort(Exception):
    """A response body failed while it was read: the request is made again."""


def read_body(response: dict[str, Any]) -> bytes:
    """The response's body, or BodyCutShort if reading it failed (truncated, reset, timed out)."""
    try:
        return response["Body"].read()
    except (botocore.exceptions.BotoCoreError, OSError, urllib3.exceptions.HTTPError) as exc:
        raise BodyCutShort(f"response body cut short: {exc!r}") from exc


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same S3 request may succeed."""
    if isinstance(exc, (BodyCutShort, *_TRANSIENT_BOTOCORE)):
        return True
    if isinstance(exc, botocore.exceptions.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = exc.response.get("Error", {}).get("Code", "")
        return status >= 500 or status == 429 or code in _TRANSIENT_CODES
    return False


def _cause(exc: BaseException) -> BaseException:
    return exc.__cause__ if isinstance(exc, BodyCutShort) and exc.__cause__ is not None else exc


def _error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix/"); the prefix may be empty."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"blob url {url!r} names no bucket; use s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


class S3BlobStore(BlobStore):
    """Blob store in an S3 bucket (AWS or any S3-compatible endpoint)."""

    def __init__(self, config: BlobStoreConfig, *, rng: random.Random | None = None) -> None:
        super().__init__(config)
        self.bucket, self.prefix = parse_s3_url(config.url)
        style = config.s3_addressing_style
        if style == "auto" and config.s3_endpoint is not None:
            style = "path"
        client_config = botocore.config.Config(
            region_name=config.s3_region,
            retries={"total_max_attempts": 1, "mode": "standard"},  # `_call` retries, with the store's backoff
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            max_pool_connections=config.max_pool_connections,
            s3={"addressing_style": style},
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=config.s3_endpoint, config=client_config)
        self._rng = rng or random.Random()
        self._closed = False

    def _full_key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    async def _call(self, op: str, key: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Run one blocking S3 request in a thread; see the module docstring for the retry policy."""
        budget = self.config.max_attempts
        used = 0
        while True:
            try:
                return await asyncio.to_thread(fn, **kwargs)
            except botocore.exceptions.NoCredentialsError:  # boto3's own words are a 70-line traceback
                raise BlobError(f"s3 {op} of {key!r} in {self.url}: no S3 credentials where this process runs: set "
                                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in its environment (or AWS_PROFILE, or "
                                "an instance role); on a Ray node, where `ray start` runs") from None
            except Exception as exc:
                if not is_transient(exc):
                    raise
                used += 1
                if used >= budget:
                    raise BlobUnavailable(
                        f"s3 {op} of {key!r} in {self.url} failed {used} times with transient errors, "
                        f"last: {_cause(exc)}; check the endpoint or raise max_attempts"
                    ) from exc
                delay_s = backoff_s(self.config, used, self._rng)
                log.warning("blob_retry", op=op, key=key, attempt=used, delay_s=round(delay_s, 3), error=str(exc))
                await asyncio.sleep(delay_s)

    # -- whole objects ---------------------------------------------------------------------------

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        full = self._full_key(key)
        view = memoryview(data)
        if view.nbytes >= self.config.multipart_threshold_bytes:
            part = self.config.multipart_part_bytes

            async def parts() -> AsyncIterator[bytes]:
                for start in range(0, view.nbytes, part):
                    yield bytes(view[start : start + part])

            await self.put_stream(key, parts())
            return
        body = bytes(view)
        await self._call("put", key, self._client.put_object, Bucket=self.bucket, Key=full, Body=body)

    async def get(self, key: str) -> bytes:
        full = self._full_key(key)

        def fetch() -> bytes:
            return read_body(self._client.get_object(Bucket=self.bucket, Key=full))

        try:
            return await self._call("get", key, fetch)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                raise BlobNotFound(key, self.url) from None
            raise

    async def _head(self, key: str) -> dict[str, Any]:
        full = self._full_key(key)
        try:
            return await self._call("head", key, self._client.head_object, Bucket=self.bucket, Key=full)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                raise BlobNotFound(key, self.url) from None
            raise

    async def exists(self, key: str) -> bool:
        try:
            await self._head(key)
        except BlobNotFound:
            return False
        return True

    async def list(self, prefix: str = "") -> list[str]:
        full_prefix = self.prefix + prefix

        def list_all() -> list[str]:
            paginator = self._client.get_paginator("list_objects_v2")
            keys: list[str] = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                keys.extend(item["Key"] for item in page.get("Contents", ()))
            return keys

        keys = await self._call("list", prefix, list_all)
        return sorted(key[len(self.prefix) :] for key in keys)

    async def delete(self, key: str) -> None:
        full = self._full_key(key)
        await self._call("delete", key, self._client.delete_object, Bucket=self.bucket, Key=full)

    # -- streams ---------------------------------------------------------------------------------

    async def put_stream(self, key: str, source: StreamSource) -> int:
        full = self._full_key(key)
        part_bytes = self.config.multipart_part_bytes
        buffer = bytearray()
        upload: _MultipartUpload | None = None
        num_bytes = 0
        try:
            async for chunk in iter_source(source, self.config.stream_chunk_bytes):
                buffer += chunk
                num_bytes += len(chunk)
                while len(buffer) >= part_bytes and (
                    upload is not None or num_bytes >= self.config.multipart_threshold_bytes
                ):
                    upload = upload or await _MultipartUpload.create(self, key, full)
                    await upload.send(bytes(buffer[:part_bytes]))
                    del buffer[:part_bytes]
            if upload is None:
                await self._call("put", key, self._client.put_object, Bucket=self.bucket, Key=full, Body=bytes(buffer))
            else:
                if buffer:
                    await upload.send(bytes(buffer))
                await upload.complete()
        except BaseException:
            if upload is not None:
                await upload.abort()
            raise
        log.debug("blob_put_stream", key=key, num_bytes=num_bytes, store=self.url)
        return num_bytes

    async def get_stream(self, key: str, chunk_bytes: int | None = None) -> AsyncIterator[bytes]:
        size = chunk_bytes or self.config.stream_chunk_bytes
        head = await self._head(key)
        total, etag = int(head["ContentLength"]), head["ETag"]
        full = self._full_key(key)
        for start in range(0, total, size):
            end = min(start + size, total) - 1

            def fetch(start: int = start, end: int = end) -> bytes:
                return read_body(self._client.get_object(
                    Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end}", IfMatch=etag
                ))

            try:
                chunk = await self._call("get_range", key, fetch)
            except botocore.exceptions.ClientError as exc:
                if _error_code(exc) in _NOT_FOUND_CODES:
                    raise BlobNotFound(key, self.url) from None
                if _error_code(exc) in ("PreconditionFailed", "412"):
                    raise BlobError(f"blob {key!r} was replaced while it was being streamed") from exc
                raise
            if len(chunk) != end - start + 1:
                raise BlobError(f"blob {key!r}: range {start}-{end} returned {len(chunk)} bytes")
            yield chunk

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._client.close)


class _MultipartUpload:
    """One S3 multipart upload: parts sent in order, then completed (visible) or aborted."""

    def __init__(self, store: S3BlobStore, key: str, full: str, upload_id: str) -> None:
        self.store, self.key, self.full, self.upload_id = store, key, full, upload_id
        self.parts: list[dict[str, Any]] = []

    @classmethod
    async def create(cls, store: S3BlobStore, key: str, full: str) -> _MultipartUpload:
        response = await store._call(
            "create_multipart", key, store._client.create_multipart_upload, Bucket=store.bucket, Key=full
        )
        return cls(store, key, full, response["UploadId"])

    async def send(self, body: bytes) -> None:
        number = len(self.parts) + 1
        response = await self.store._call(
            "upload_part",
            self.key,
            self.store._client.upload_part,
            Bucket=self.store.bucket,
            Key=self.full,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
        )
        self.parts.append({"PartNumber": number, "ETag": response["ETag"]})

    async def complete(self) -> None:
        await self.store._call(
            "complete_multipart",
            self.key,
            self.store._client.complete_multipart_upload,
            Bucket=self.store.bucket,
            Key=self.full,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    async def abort(self) -> None:
        with contextlib.suppress(Exception):
            await self.store._call(
                "abort_multipart",
                self.key,
                self.store._client.abort_multipart_upload,
                Bucket=self.store.bucket,
                Key=self.full,
                UploadId=self.upload_id,
            )
        log.info("blob_multipart_aborted", key=self.key, store=self.store.url)
