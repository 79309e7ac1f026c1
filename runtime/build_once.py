"""A one-time build shared by every process of a run, on any machine: one builds, the others wait.

The result is a directory, stored in the run's blob store as the tree ``builds/<name>`` (manifest last:
``runtime.blob.put_tree``) and fetched by everyone into a local cache. Who builds is decided on the bus:
the lease ``build.<name>`` in the ``run`` bucket (``runtime.kv_lease``: create-if-absent, so one
process wins; renewed every third of ``lease_s``).

- The builder builds in a temporary folder while it renews its lease, stores the tree, then releases.
- The others watch the lease: a renewal says the builder lives, a release wakes them to fetch the
  tree; a lease nobody renewed for ``lease_s`` is a dead builder's, and one of them takes it over and
  builds.
- A build that raises releases the lease and raises ``BuildFailed`` in its process: the next waiter
  takes the lease and tries in its turn (the supervisor's restart limit bounds a build that always fails).
- Every wait is bounded by ``timeout_s``, the longest a build may take.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from runtime.blob import BlobStore, get_tree, put_tree, tree_exists
from runtime.bus import Bus
from runtime.kv_lease import KVLease
from runtime.run_state import RUN_BUCKET

log = structlog.get_logger(__name__)

__all__ = ["BUILDS_PREFIX", "BuildFailed", "BuildSettings", "build_locally", "build_once", "claim_key"]

BUILDS_PREFIX = "builds"


class BuildFailed(RuntimeError):
    """The build raised in this process (its lease is released for another to try)."""


@dataclass(frozen=True)
class BuildSettings:
    lease_s: float = 30.0  # a builder that did not renew its lease for this long is dead
    timeout_s: float = 3600.0  # the longest a process waits for the result, its own build included

    def __post_init__(self) -> None:
        if not 0 < self.lease_s <= self.timeout_s:
            raise ValueError(f"lease_s={self.lease_s}, timeout_s={self.timeout_s}: need 0 < lease_s <= timeout_s")


def claim_key(name: str) -> str:
    """The key of build ``name``'s lease in the run bucket."""
    return f"build.{name}"


async def build_once(bus: Bus, store: BlobStore, name: str, build: Callable[[Path], object], cache_dir: Path,
                     *, owner: str, settings: BuildSettings = BuildSettings()) -> Path:
    """``cache_dir/name``, holding the run's build ``name``: fetched from the store, or built here once.

    Args:
        build: fills the folder it is given (called in a thread, in at most one live process at a time).
        owner: who this process is, written in the lease for whoever reads it.

    Raises:
        BuildFailed: this process's build raised.
        TimeoutError: no result within ``settings.timeout_s``.
    """
    prefix = f"{BUILDS_PREFIX}/{name}"
    destination = cache_dir / name
    cache_dir.mkdir(parents=True, exist_ok=True)
    lease = KVLease(bus, RUN_BUCKET, claim_key(name),
                    json.dumps({"owner": owner, "pid": os.getpid()}).encode(), settings.lease_s)
    started = time.monotonic()
    async with asyncio.timeout(settings.timeout_s):
        while True:
            if await tree_exists(store, prefix):
                path = await get_tree(store, prefix, destination)
                log.info("build_fetched", name=name, wait_s=round(time.monotonic() - started, 2))
                return path
            if await lease.acquire():
                try:
                    return await _build(store, name, build, destination, owner, lease)
                finally:
                    await lease.release()


async def _build(store: BlobStore, name: str, build: Callable[[Path], object], destination: Path, owner: str,
                 lease: KVLease) -> Path:
    tmp = destination.with_name(f".building-{name}-{os.getpid()}")
    await asyncio.to_thread(shutil.rmtree, tmp, True)
    tmp.mkdir(parents=True)
    started = time.monotonic()
    log.info("build_started", name=name, owner=owner)
    try:
        error: Exception | None = None
        async with asyncio.TaskGroup() as tg:
            renewing = tg.create_task(lease.keep())
            try:
                await asyncio.to_thread(build, tmp)
            except Exception as e:  # raised below, outside the task group (which would wrap it in a group)
                error = e
            finally:
                renewing.cancel()
        if error is not None:
            log.error("build_failed", name=name, owner=owner, error=repr(error))
            raise BuildFailed(f"the build of {name} raised {error!r}") from error
        await put_tree(store, tmp, f"{BUILDS_PREFIX}/{name}")
        path = await get_tree(store, f"{BUILDS_PREFIX}/{name}", destination)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    log.info("build_stored", name=name, owner=owner, build_s=round(time.monotonic() - started, 2))
    return path


def build_locally(cache_dir: Path, name: str, build: Callable[[Path], object], done: Callable[[Path], bool]) -> Path:
    """``cache_dir/name``, built here by ``build`` unless ``done`` finds it finished: outside a run (benchmarks,
    the command line, tests), where no bus decides who builds. Under a file lock, so concurrent callers on
    this machine build once; in a temporary folder renamed into place, so an interrupted build leaves
    nothing that looks finished."""
    target = cache_dir / name
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done(target):
            return target
        log.info("build_started", name=name, owner=f"pid {os.getpid()}")
        tmp = Path(tempfile.mkdtemp(prefix=f".building-{name}-", dir=cache_dir))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
