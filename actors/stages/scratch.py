"""Where an actor's sandboxes live on the host: one directory per (actor kind, run), shared by its processes.

A process killed with SIGKILL cannot remove its sandbox store or unmount its overlays. With a root
per process (``/var/tmp/rollout-<random>``) nobody ever looked there again: every kill left a
directory, and a rollout actor killed mid-batch 64 overlay mounts. With one root per kind and run,
the process that replaces it opens a `sandbox.LayerStore` in the same root, and the store reaps at
start every sibling store (mounts first) whose process is gone. The root itself is removed by the
last process of the kind to stop (it is only removed when empty, so live siblings keep theirs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
from pathlib import Path

import structlog

from sandbox import LayerStore, SandboxConfig

log = structlog.get_logger(__name__)

__all__ = ["SCRATCH_DIR", "open_sandbox_store", "scratch_root"]

SCRATCH_DIR = Path("/var/tmp")
# sandbox._ids's claims of host uids, one locked byte each, which stores kept in their root before
# they moved to one file per host (SandboxConfig.env_uid_claims); a root made then may still hold it
UID_CLAIMS = "env-uids.lock"


def scratch_root(kind: str, run_dir: Path | str) -> Path:
    """``/var/tmp/<kind>-<8 hex digits of the run directory's absolute path>``: stable across restarts."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return SCRATCH_DIR / f"{kind}-{digest}"


def open_sandbox_store(kind: str, run_dir: Path | str, exit_stack: contextlib.ExitStack | contextlib.AsyncExitStack,
                       ) -> LayerStore:  # fmt: skip
    """This process's sandbox store under its kind's root (reaping dead siblings'); closed by ``exit_stack``."""
    root = scratch_root(kind, run_dir)
    store = LayerStore(SandboxConfig(root_dir=str(root)))
    exit_stack.callback(_remove_if_empty, root)
    exit_stack.callback(store.close)
    return store


def _remove_if_empty(root: Path) -> None:
    with contextlib.suppress(FileNotFoundError, OSError):  # OSError: ENOTEMPTY, a sibling still works here
        _remove_uid_claims_if_unused(root)
        os.rmdir(root)
        log.info("scratch_root_removed", root=str(root))


def _remove_uid_claims_if_unused(root: Path) -> None:
    """Remove the uid claim file stores of earlier versions kept in their root (``<root>/env-uids.lock``,
    which none removed; stores now claim uids in one file per host) when it is all the root holds and no
    store holds a claim in it, so a root made by them can still be removed.

    Such a store made its directory in the root before it opened the file, so with no store directory
    seen while holding the whole file's lock, no live store has it open."""
    lock = root / UID_CLAIMS
    if os.listdir(root) != [UID_CLAIMS]:
        return
    fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    try:
        whole = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # struct flock: every byte, l_pid 0
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, whole)
        except BlockingIOError:  # a store still holds a uid's claim
            return
        if os.listdir(root) == [UID_CLAIMS]:
            os.unlink(lock)
    finally:
        os.close(fd)
