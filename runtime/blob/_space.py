"""A full file system under the store is an outage to wait out, not a failure of the write.

A write that fails for lack of space (ENOSPC, EDQUOT) is tried again after a capped, jittered backoff
until it succeeds, for at most ``BlobStoreConfig.max_full_s``. The store says so once per outage
(``storage_full``, with its path and free space, from the first writer that met it) and once when a
write that waited succeeds (``storage_recovered``, with how long it lasted); the writers waiting meanwhile
say nothing more, and a small write that fits while a large one waits ends nothing. Past ``max_full_s``
the write raises :class:`StorageFull`: the outage is then the operator's to fix, and every caller's own
failure path applies (the trainer rolls back to its stored checkpoint, an order is redelivered).
Retrying costs nothing the write has not already spent: a whole-object write is tried again from its
bytes, a stream's chunk from where the disk refused it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import time
from pathlib import Path

import structlog

from runtime.blob._base import BlobStoreConfig, BlobUnavailable, backoff_s

__all__ = ["SPACE_ERRNOS", "SpaceOutage", "StorageFull", "free_bytes", "is_space_error"]

log = structlog.get_logger(__name__)

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class StorageFull(BlobUnavailable):
    """The store's file system stayed full for longer than ``max_full_s``."""


def is_space_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use at ``path``'s file system (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SpaceOutage:
    """One store's full-disk state, shared by every write that meets it."""

    def __init__(self, config: BlobStoreConfig, path: Path) -> None:
        self.config = config
        self.path = path
        self.full_since: float | None = None
        self.num_outages = 0
        self._num_waiting = 0
        self._waiting_since: float | None = None  # since when some write waits for space (None: none does)
        self._waited_s = 0.0  # time some write waited for space, before `_waiting_since`
        self._rng = random.Random()

    @property
    def num_waiting(self) -> int:
        """Writes waiting for space now."""
        return self._num_waiting

    @num_waiting.setter
    def num_waiting(self, n: int) -> None:
        now = time.monotonic()
        if n and self._waiting_since is None:
            self._waiting_since = now
        elif not n and self._waiting_since is not None:
            self._waited_s += now - self._waiting_since
            self._waiting_since = None
        self._num_waiting = n

    def waited_s(self) -> float:
        """Seconds during which some write of this store waited for space, so far (a clock that runs only
        then): an actor's work timing leaves it out, so that the health checks do not take a handling
        waiting out a full disk for a stuck one (runtime.work_timing)."""
        since = self._waiting_since
        return self._waited_s + (time.monotonic() - since if since is not None else 0.0)

    async def wait(self, op: str, key: str, error: OSError, attempt: int) -> None:
        """Waits before try number ``attempt + 1`` of a write that found the disk full; raises StorageFull
        once the outage has lasted ``max_full_s``."""
        now = time.monotonic()
        if self.full_since is None:
            self.full_since = now
            self.num_outages += 1
            log.warning("storage_full", path=str(self.path), free_bytes=free_bytes(self.path), op=op, key=key,
                        error=str(error), max_full_s=self.config.max_full_s,
                        consequence="writes wait for space (no restart, nothing dropped, and the health checks "
                                    "do not count the wait against a handling); free space under the store's "
                                    "path and the run goes on by itself")
        full_s = now - self.full_since
        if full_s >= self.config.max_full_s:
            raise StorageFull(f"blob store {self.config.url} has been full for {full_s:.0f}s "
                              f"(blob max_full_s={self.config.max_full_s:g}; {free_bytes(self.path)} bytes free "
                              f"at {self.path}); {op} of {key!r} failed: {error}. Free space there or grow it") \
                from error
        delay_s = min(backoff_s(self.config, attempt, self._rng), self.config.max_full_s - full_s)
        await asyncio.sleep(delay_s)

    def wrote(self, waited: bool) -> None:
        """A write succeeded: an outage in progress is over if it is one that waited for space, or none is
        waiting (a small write that fits beside a large one still waiting ends nothing: said once)."""
        if self.full_since is None or not (waited or self.num_waiting == 0):
            return
        full_s = time.monotonic() - self.full_since
        self.full_since = None
        log.info("storage_recovered", path=str(self.path), free_bytes=free_bytes(self.path), full_s=round(full_s, 3))
