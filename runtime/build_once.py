"""A one-time build shared by every process of a run, on any machine: one builds, the others wait.

The result is a directory, stored in the run's blob store as the tree ``builds/<name>`` (manifest last:
``runtime.blob.put_tree``) and fetched by everyone into a local cache. Who builds is decided on the bus:
the lease ``build.<name>`` in the ``run`` bucket (``runtime.kv_lease``: create-if-absent, so one
process wins; renewed every third of ``lease_s``).

- The builder builds in a temporary folder while it renews its lease, stores the tree, then releases.
- The others watch the lease: a renewal says the builder lives, a release wakes them to fetch the
  tree; a lease nobody renewed for ``lease_s`` is a dead builder's, and one of them takes it over and
  builds.
- A process that only reads the build (``build=None``: the dashboard, which needs a policy's tokenizer and
  must not build a policy) never claims the lease: it looks for the tree once its watch of the lease is
  open and again at each release, and fetches what it needs (``members``: only those files).
- A build found finished on a machine before the run stored it is stored under the lease too
  (`share_build`): a tree appears only while the lease is held, so its release is the one event to wait for.
- A build that raises releases the lease and raises ``BuildFailed`` in its process: the next waiter
  takes the lease and tries in its turn (the supervisor's restart limit bounds a build that always fails).
- Every wait is bounded by ``timeout_s``, the longest a build may take.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import structlog

from runtime.blob import BlobStore, get_tree, put_tree, tree_exists
from runtime.bus import Bus
from runtime.kv_lease import KVLease
from runtime.run_state import RUN_BUCKET

log = structlog.get_logger(__name__)

__all__ = ["BUILDS_PREFIX", "BuildFailed", "BuildSettings", "build_locally", "build_once", "claim_key", "share_build"]

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


async def build_once(bus: Bus | None, store: BlobStore, name: str, build: Callable[[Path], object] | None,
                     cache_dir: Path, *, owner: str, settings: BuildSettings = BuildSettings(),
                     members: Collection[str] | None = None, on_wait: Callable[[], object] | None = None) -> Path:
    """``cache_dir/name``, holding the run's build ``name``: fetched from the store, or built here once.

    Args:
        bus: the run's bus; None (a finished run's reader, only without ``build``): the build as stored.
        build: fills the folder it is given (called in a thread, in at most one live process at a time);
            None: this process never builds, it waits for the process that does.
        owner: who this process is, written in the lease for whoever reads it.
        members: only these files of the build (those it has), into ``cache_dir/<name>.part-<hash>``: never
            taken for the whole build by whoever looks for it in the cache. Only without ``build``.
        on_wait: called once if this process, not building, starts waiting for the build (it is not stored yet).

    Raises:
        BuildFailed: this process's build raised.
        TimeoutError: no result within ``settings.timeout_s``.
        FileNotFoundError: without a bus, the build is not stored.
    """
    if build is not None and (members is not None or bus is None):
        raise ValueError(f"build {name}: a builder needs the bus and fetches the whole tree (bus={bus}, "
                         f"members={members})")
    prefix = f"{BUILDS_PREFIX}/{name}"
    destination = cache_dir / (name if members is None else f"{name}.part-{_members_tag(members)}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    lease = KVLease(bus, RUN_BUCKET, claim_key(name), _holder(owner), settings.lease_s) if build else None
    started = time.monotonic()
    async with asyncio.timeout(settings.timeout_s):
        while True:
            if await tree_exists(store, prefix):
                path = await get_tree(store, prefix, destination, members)
                log.info("build_fetched", name=name, wait_s=round(time.monotonic() - started, 2),
                         members=sorted(members) if members is not None else None)
                return path
            if bus is None:
                raise FileNotFoundError(f"the build {name} is not stored in {store.url} (under {prefix}/): the run "
                                        "never finished it; resume the run to build it")
            if build is None or lease is None:
                log.info("build_waiting", name=name, owner=owner, timeout_s=settings.timeout_s)
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                await _until_stored(bus, store, name)
            elif await lease.acquire():
                try:
                    return await _build(store, name, build, destination, owner, lease)
                finally:
                    await lease.release()


def _holder(owner: str) -> bytes:
    return json.dumps({"owner": owner, "pid": os.getpid()}).encode()


async def _until_stored(bus: Bus, store: BlobStore, name: str) -> None:
    """Until the build ``name``'s tree is stored: looked for once the watch of its lease is open (so a tree
    stored just before is not missed), then at each release of the lease (a tree is stored only under it)."""
    async with contextlib.aclosing(bus.kv_watch(RUN_BUCKET, claim_key(name))) as changes:
        async for entry in changes:  # None: the current record is in (or there is none)
            if (entry is None or entry.deleted) and await tree_exists(store, f"{BUILDS_PREFIX}/{name}"):
                return


def _members_tag(members: Collection[str]) -> str:
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:12]


async def share_build(bus: Bus, store: BlobStore, name: str, directory: Path, *, owner: str,
                      settings: BuildSettings = BuildSettings()) -> bool:
    """Stores ``directory``, the finished build ``name`` found on this machine, for the other machines, unless
    it is stored already; under the build's lease, as a build is, so that its waiters wake at the release.
    A lease held by another (building or sharing it now) is left to them. True when this process stored it."""
    prefix = f"{BUILDS_PREFIX}/{name}"
    if await tree_exists(store, prefix):
        return False
    lease = KVLease(bus, RUN_BUCKET, claim_key(name), _holder(owner), settings.lease_s)
    if not await lease.try_acquire():
        return False
    try:
        if await tree_exists(store, prefix):  # stored between the look and the claim
            return False
        async with asyncio.TaskGroup() as tg:
            renewing = tg.create_task(lease.keep())
            try:
                num_bytes = await put_tree(store, directory, prefix)
            finally:
                renewing.cancel()
    finally:
        await lease.release()
    log.info("build_shared", name=name, owner=owner, num_bytes=num_bytes)
    return True


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
