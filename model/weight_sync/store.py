"""What weight sync needs from a blob store, and the retry of its transient failures.

Any object with async ``put/get/list/delete`` fits (``runtime.blob.BlobStore`` does): missing keys
raise KeyError and transient failures ConnectionError or TimeoutError, which are retried with capped,
jittered exponential backoff, unless the store says it already retried them (``retried`` on the error:
``runtime.blob.BlobUnavailable``): one retry policy, never stacked (a store that retries 5 times under
5 retries here made 25 attempts). Other errors (a full disk, a permission, a missing path) are never
retried: they fail the same way every time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import structlog

__all__ = ["BlobStoreLike", "Retry", "all_shards"]

log = structlog.get_logger(__name__)
T = TypeVar("T")


class BlobStoreLike(Protocol):
    """What the publisher and subscriber need from a blob store."""

    async def put(self, key: str, data: bytes) -> None: ...
    async def get(self, key: str) -> bytes: ...
    async def list(self, prefix: str = "") -> list[str]: ...
    async def delete(self, key: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Retry:
    """Retries of transient storage errors (module docstring): ``attempts`` tries, backoff in [base_s, max_s]."""

    attempts: int
    base_s: float
    max_s: float

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError(
                f"max_attempts={self.attempts}, backoff_base_s={self.base_s}, backoff_max_s={self.max_s}: "
                "need attempts >= 1 and 0 <= base <= max"
            )

    async def run(self, op: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()``, retrying transient errors with backoff; the last failure propagates."""
        # doubled as it goes, not base * 2 ** attempt, which overflows from attempt 1025 of a large
        # max_attempts (runtime.backoff, which this layer may not import, says the same of the runtime's)
        cap = min(self.max_s, self.base_s)
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except (ConnectionError, TimeoutError) as exc:
                if attempt == self.attempts or getattr(exc, "retried", False):
                    raise
                delay_s = cap / 2 + random.uniform(0, cap / 2)
                cap = min(self.max_s, cap * 2)
                log.warning("weights_storage_retry", op=op, key=key, attempt=attempt, delay_s=delay_s, error=str(exc))
                await asyncio.sleep(delay_s)
        raise AssertionError("unreachable")  # pragma: no cover


async def all_shards(*transfers: Coroutine[Any, Any, T]) -> list[T]:
    """A version's shard transfers, side by side; the first to fail cancels the others, which are
    awaited before its error is raised, so no upload or download outlives its version's failure.
    (``runtime.gather.gather_or_cancel`` does the same above this layer, which may not import
    ``runtime``; it says why this is not a TaskGroup.)"""
    tasks = [asyncio.ensure_future(t) for t in transfers]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        raise
