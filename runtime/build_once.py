"""A one-time build shared by every process of a run, on any machine: one builds, the others wait.

The result is a directory, stored in the run's blob store as the tree ``builds/<name>`` (manifest last:
``runtime.blob.put_tree``) and fetched by everyone into a local cache. Who builds is decided on the bus:
the claim ``build.<name>`` in the ``run`` bucket, made with create-if-absent, so one process wins.

- The builder renews its claim every third of ``lease_s`` (a compare-and-set on its revision), builds
  in a temporary folder, stores the tree, then deletes the claim.
- The others watch the claim. A renewal or a delete wakes them (event-driven, no polling): the tree is
  there, or someone else claims next. A claim not renewed for ``lease_s`` is a dead builder's: a
  waiter takes it over with a compare-and-set on the revision it saw, and builds.
- A build that raises deletes its claim and raises ``BuildFailed`` in its process: the next waiter
  claims and tries in its turn (the supervisor's restart limit bounds a build that always fails).
- Every wait is bounded by ``timeout_s``, the longest a build may take.

Liveness is judged by renewals seen, not by clocks: machines need not agree on the time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from runtime.blob import BlobStore, get_tree, put_tree, tree_exists
from runtime.bus import Bus, KVEntry
from runtime.errors import RevisionMismatch
from runtime.run_state import RUN_BUCKET

log = structlog.get_logger(__name__)

__all__ = ["BUILDS_PREFIX", "BuildFailed", "BuildSettings", "build_once", "claim_key"]

BUILDS_PREFIX = "builds"


class BuildFailed(RuntimeError):
    """The build raised in this process (its claim is released for another to try)."""


@dataclass(frozen=True)
class BuildSettings:
    lease_s: float = 30.0  # a claim not renewed for this long is a dead builder's
    timeout_s: float = 3600.0  # the longest a process waits for the result, its own build included

    def __post_init__(self) -> None:
        if not 0 < self.lease_s <= self.timeout_s:
            raise ValueError(f"lease_s={self.lease_s}, timeout_s={self.timeout_s}: need 0 < lease_s <= timeout_s")


def claim_key(name: str) -> str:
    return f"build.{name}"


async def build_once(bus: Bus, store: BlobStore, name: str, build: Callable[[Path], object], cache_dir: Path,
                     *, owner: str, settings: BuildSettings = BuildSettings()) -> Path:
    """``cache_dir/name``, holding the run's build ``name``: fetched from the store, or built here once.

    Args:
        build: fills the folder it is given (called in a thread, in at most one process at a time).
        owner: who this process is, for the claim and the events.

    Raises:
        BuildFailed: this process's build raised.
        TimeoutError: no result within ``settings.timeout_s``.
    """
    prefix = f"{BUILDS_PREFIX}/{name}"
    destination = cache_dir / name
    cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    async with asyncio.timeout(settings.timeout_s):
        while True:
            if await tree_exists(store, prefix):
                path = await get_tree(store, prefix, destination)
                log.info("build_fetched", name=name, wait_s=round(time.monotonic() - started, 2))
                return path
            revision = await _claim(bus, name, owner)
            if revision is None:  # someone else holds it
                entry = await bus.kv_get(RUN_BUCKET, claim_key(name))
                if entry is None or await _changes_within(bus, name, entry.revision, settings.lease_s):
                    continue
                revision = await _take_over(bus, name, owner, entry)
                if revision is None:
                    continue
            return await _build(bus, store, name, build, destination, owner, revision, settings.lease_s)


def _claim_value(owner: str) -> bytes:
    return json.dumps({"owner": owner, "pid": os.getpid(), "claimed_at": time.time()}).encode()


async def _claim(bus: Bus, name: str, owner: str) -> int | None:
    try:
        revision = await bus.kv_create(RUN_BUCKET, claim_key(name), _claim_value(owner))
    except RevisionMismatch:
        return None
    log.info("build_claimed", name=name, owner=owner)
    return revision


async def _take_over(bus: Bus, name: str, owner: str, seen: KVEntry) -> int | None:
    try:
        revision = await bus.kv_cas(RUN_BUCKET, claim_key(name), _claim_value(owner), seen.revision)
    except RevisionMismatch:  # renewed, released or taken over by another meanwhile
        return None
    log.warning("build_taken_over", name=name, owner=owner, dead_claim=seen.value.decode(errors="replace"))
    return revision


async def _changes_within(bus: Bus, name: str, revision: int, window_s: float) -> bool:
    """Whether the claim changes (renewed, released, taken over) past ``revision`` within ``window_s``."""
    try:
        async with asyncio.timeout(window_s), contextlib.aclosing(bus.kv_watch(RUN_BUCKET, claim_key(name))) as w:
            async for entry in w:
                if entry is not None and (entry.revision > revision or entry.deleted):
                    return True
    except TimeoutError:
        return False
    return True


async def _build(bus: Bus, store: BlobStore, name: str, build: Callable[[Path], object], destination: Path,
                 owner: str, revision: int, lease_s: float) -> Path:
    prefix = f"{BUILDS_PREFIX}/{name}"
    tmp = destination.with_name(f".building-{name}-{os.getpid()}")
    await asyncio.to_thread(shutil.rmtree, tmp, True)
    tmp.mkdir(parents=True)
    started = time.monotonic()
    log.info("build_started", name=name, owner=owner)
    try:
        error: Exception | None = None
        async with asyncio.TaskGroup() as tg:
            renewing = tg.create_task(_renew(bus, name, owner, revision, lease_s))
            try:
                await asyncio.to_thread(build, tmp)
            except Exception as e:  # raised below, outside the task group (which would wrap it in a group)
                error = e
            finally:
                renewing.cancel()
        if error is not None:
            raise BuildFailed(f"the build of {name} raised {error!r}") from error
        await put_tree(store, tmp, prefix)
        path = await get_tree(store, prefix, destination)
    except BaseException as e:
        log.error("build_failed", name=name, owner=owner, error=repr(e))
        with contextlib.suppress(OSError):  # the claim lapses by itself if the bus is down
            await bus.kv_delete(RUN_BUCKET, claim_key(name))
        raise
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    await bus.kv_delete(RUN_BUCKET, claim_key(name))
    log.info("build_stored", name=name, owner=owner, build_s=round(time.monotonic() - started, 2))
    return path


async def _renew(bus: Bus, name: str, owner: str, revision: int, lease_s: float) -> None:
    """Renews the claim every third of the lease; a claim taken over meanwhile (we looked dead) is left
    to its new holder: both builds give the same tree, and each store is atomic."""
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            revision = await bus.kv_cas(RUN_BUCKET, claim_key(name), _claim_value(owner), revision)
        except RevisionMismatch:
            log.warning("build_claim_lost", name=name, owner=owner)
            return
        except OSError as e:  # the bus is down: try again next time (the claim may lapse meanwhile)
            log.warning("build_claim_not_renewed", name=name, owner=owner, error=repr(e))
