"""A lease on one key of a KV bucket: one holder at a time, on any machine, and a dead holder noticed.

The holder creates the key (create-if-absent) and renews it every third of ``lease_s`` with a
compare-and-set on its revision; it deletes it when done. Someone else who wants it watches the key:
a renewal says the holder lives, a delete frees it; a key nobody renewed for ``lease_s`` is a dead
holder's, and the first to compare-and-set on the revision it saw takes it over. Liveness is judged by
renewals seen, not by clocks, so machines need not agree on the time.

Used by the run's one-time builds (``runtime.build_once``) and by runtime.up, so that one supervisor
at a time runs a run (``runtime.up --resume`` elsewhere waits for a killed one's lease to lapse).
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from runtime.bus import Bus, KVEntry
from runtime.errors import RevisionMismatch

log = structlog.get_logger(__name__)

__all__ = ["KVLease"]


class KVLease:
    """The lease on ``bucket/key``, held with ``value`` (who holds it, for whoever reads it)."""

    def __init__(self, bus: Bus, bucket: str, key: str, value: bytes, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s={lease_s} must be > 0")
        self.bus, self.bucket, self.key, self.value, self.lease_s = bus, bucket, key, value, lease_s
        self.revision: int | None = None  # while held

    @property
    def held(self) -> bool:
        return self.revision is not None

    async def holder(self) -> KVEntry | None:
        """The key's current record: who holds the lease now, if anyone."""
        return await self.bus.kv_get(self.bucket, self.key)

    async def try_acquire(self) -> bool:
        """Takes the lease if nobody holds it, at once: no wait, no takeover of a lapsed one."""
        try:
            self.revision = await self.bus.kv_create(self.bucket, self.key, self.value)
        except RevisionMismatch:
            return False
        return True

    async def acquire(self) -> bool:
        """Takes the lease if it is free, or lapsed (waiting up to one lease to tell). False: its holder
        renewed it (alive) or released it meanwhile; the caller looks again at what it waits for (what
        a released lease guarded may be done) before it tries again. Bounded by ``lease_s``."""
        if await self.try_acquire():
            return True
        seen = await self.holder()
        if seen is None or await self._changes_within(seen.revision):
            return False
        try:
            self.revision = await self.bus.kv_cas(self.bucket, self.key, self.value, seen.revision)
        except RevisionMismatch:  # renewed, released or taken over by another meanwhile
            return False
        log.warning("lease_taken_over", key=f"{self.bucket}/{self.key}", lapsed_holder=seen.value.decode(
            errors="replace"), lease_s=self.lease_s)
        return True

    async def _changes_within(self, revision: int) -> bool:
        try:
            async with asyncio.timeout(self.lease_s), contextlib.aclosing(
                    self.bus.kv_watch(self.bucket, self.key)) as changes:
                async for entry in changes:
                    if entry is not None and (entry.revision > revision or entry.deleted):
                        return True
        except TimeoutError:
            return False
        return True

    async def keep(self) -> None:
        """Renews the lease every third of ``lease_s`` until cancelled; returns if it is lost (taken over
        by another who saw it lapse). A renewal the bus refuses is tried again at the next one; one refused
        because the key moved on is checked: a renewal of this lease that timed out but landed keeps it."""
        while self.revision is not None:
            await asyncio.sleep(self.lease_s / 3)
            try:
                self.revision = await self.bus.kv_cas(self.bucket, self.key, self.value, self.revision)
            except RevisionMismatch:
                try:
                    current = await self.holder()
                except OSError as e:  # cannot tell who holds it now: asked again at the next renewal
                    log.warning("lease_not_renewed", key=f"{self.bucket}/{self.key}", error=repr(e))
                    continue
                if current is not None and not current.deleted and current.value == self.value:
                    # a renewal whose answer was lost (the bus answered too late) landed after all: still ours
                    log.info("lease_renewal_confirmed", key=f"{self.bucket}/{self.key}", revision=current.revision)
                    self.revision = current.revision
                    continue
                log.warning("lease_lost", key=f"{self.bucket}/{self.key}", holder=None if current is None
                            else current.value.decode(errors="replace"))
                self.revision = None
            except OSError as e:  # the bus is down or slow: the lease may lapse meanwhile
                log.warning("lease_not_renewed", key=f"{self.bucket}/{self.key}", error=repr(e))

    async def release(self) -> None:
        """Deletes the key if this lease still holds it; quiet when the bus is down (it lapses by itself)."""
        revision, self.revision = self.revision, None
        if revision is None:
            return
        with contextlib.suppress(OSError):
            async with asyncio.timeout(5.0):
                current = await self.holder()
                if current is not None and current.revision == revision:  # not taken over since
                    await self.bus.kv_delete(self.bucket, self.key)
