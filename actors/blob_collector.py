"""Collecting the blobs of finished groups: a long run's storage stays bounded.

Every sample writes ``samples/<sample id>/a<attempt>/...`` (trajectory, workspace, reward record), every
group ``groups/<group id>/a<attempt>``; nothing read them again once their group was trained or dropped,
and nothing deleted them. The reconciler tells the collector which groups left the table, and at which
trainer version (`retire`); their blobs, every attempt's, are deleted once the trainer is
``retention_versions`` versions past that (`advance`), so the newest ones stay there to be looked at.

What is pending is kept in memory; after a restart, `sweep` lists the store and retires every group
that has blobs but is no longer in the table, at the current version. A straggler (an attempt that
was superseded but still wrote its blobs after its group was collected) is caught by the next sweep.
Deletion runs in the collector's own task, never in the reconciler's path; a failed deletion is
logged and left for the next sweep.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from runtime.blob import BlobError

log = structlog.get_logger(__name__)

__all__ = ["BlobCollector"]

SAMPLES_PREFIX = "samples/"
GROUPS_PREFIX = "groups/"


class BlobCollector:
    """Deletes finished groups' blobs ``retention_versions`` versions after they finished (see the module)."""

    def __init__(self, blob: Any, *, group_size: int, retention_versions: int,
                 is_live: Callable[[str], bool]) -> None:  # fmt: skip
        """``is_live(group_id)``: the group is in the table now (its blobs are never touched then)."""
        self.blob, self.group_size, self.retention_versions = blob, group_size, retention_versions
        self.is_live = is_live
        self._pending: collections.deque[tuple[int, str]] = collections.deque()  # (finished at version, group id)
        self._queued: set[str] = set()
        self._version = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing due is left undeleted
        self.num_deleted = 0

    def retire(self, group_ids: Iterable[str], version: int) -> None:
        """These groups left the table (trained or dropped) when the trainer was at ``version``."""
        for group_id in sorted(set(group_ids) - self._queued):
            self._queued.add(group_id)
            self._pending.append((version, group_id))
        self._idle.clear()
        self._wake.set()

    def advance(self, version: int) -> None:
        """The trainer is at ``version``: groups finished ``retention_versions`` before it go."""
        if version > self._version:
            self._version = version
            self._idle.clear()
            self._wake.set()

    async def wait_idle(self) -> None:
        """Until everything due so far is deleted (`run` must be running)."""
        await self._idle.wait()

    async def sweep(self, version: int) -> None:
        """Retire every group with blobs in the store that is not live (pending work lost with a restart).

        Liveness is asked after the listing: a group's blobs are written after it was admitted."""
        keys = await self.blob.list(GROUPS_PREFIX) + await self.blob.list(SAMPLES_PREFIX)
        found = {_group_of(key) for key in keys} - {None}
        self.retire((g for g in found if g is not None and not self.is_live(g)), version)

    async def run(self) -> None:
        """Forever: delete what is due, then wait for a retirement or a new version."""
        while True:
            self._wake.clear()
            due: list[str] = []
            while self._pending and self._pending[0][0] + self.retention_versions <= self._version:
                _, group_id = self._pending.popleft()
                self._queued.discard(group_id)
                if self.is_live(group_id):  # cannot happen (ids are never reused); never delete live work
                    log.error("blob_gc_skipped_live_group", group_id=group_id)
                    continue
                due.append(group_id)
            if due:
                await self._delete_groups(due)
            if not self._wake.is_set():
                self._idle.set()
            await self._wake.wait()

    async def _delete_groups(self, group_ids: list[str]) -> None:
        """Every attempt's blobs of these groups, in one call to the store (one thread hop on a file store)."""
        prefixes = []
        for group_id in group_ids:
            prefixes.append(f"{GROUPS_PREFIX}{group_id}/")
            prefixes += [f"{SAMPLES_PREFIX}{group_id}-s{j}/" for j in range(self.group_size)]
        try:
            num_deleted = await self.blob.delete_prefixes(prefixes)
        except (BlobError, OSError) as e:  # left for the next sweep; storage trouble is the store's to report
            log.warning("blob_gc_failed", group_ids=group_ids[:20], num_groups=len(group_ids), error=repr(e))
            return
        self.num_deleted += num_deleted
        log.debug("blobs_collected", group_ids=group_ids[:20], num_groups=len(group_ids), num_deleted=num_deleted)


def _group_of(key: str) -> str | None:
    """The group id a sample or group blob belongs to (sample ids are ``<group id>-s<index>``)."""
    if key.startswith(GROUPS_PREFIX):
        return key[len(GROUPS_PREFIX):].split("/", 1)[0] or None
    if key.startswith(SAMPLES_PREFIX):
        sample_id = key[len(SAMPLES_PREFIX):].split("/", 1)[0]
        group_id, sep, index = sample_id.rpartition("-s")
        return group_id if sep and index.isdigit() else None
    return None
