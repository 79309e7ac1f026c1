"""Optional per-environment memory cgroup (v1 or v2), capping the sum over all of its processes.

RLIMIT_AS bounds each process; a cgroup bounds their total (and the tmpfs pages they write).
It is used when this process may create a child of its own memory cgroup and move a forked
child into it (checked once by `probe`); otherwise sandboxes fall back to rlimits alone and
`probe` says why. Each environment has its own cgroup, with a spawner thread placed in it once
(`sandbox._spawner`): commands forked there are born in it (on cgroup v2, where only whole
processes join, the forked child joins while still root, in `sandbox._child`). Moving a task
into a cgroup costs an RCU grace period, so a closed environment's cgroup and its placed thread
go back to a `CgroupPool` and serve the next environment under its own limit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
import time

import structlog

from sandbox import _child
from sandbox._spawner import Spawner

__all__ = ["CgroupPool", "EnvCgroup", "find_memory_cgroup", "probe", "reap_stale"]

log = structlog.get_logger(__name__)

_PREFIX = "asyncrl-"


def find_memory_cgroup() -> tuple[str, int] | None:
    """(directory of this process's memory cgroup, cgroup version) or None."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = "/sys/fs/cgroup/memory" + path
            if os.path.isfile(os.path.join(d, "memory.limit_in_bytes")):
                return d, 1
    for line in lines:
        if line.startswith("0::"):
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                d = root + line[3:]
                try:
                    with open(os.path.join(d, "cgroup.subtree_control"), encoding="utf-8") as f:
                        if "memory" in f.read().split():
                            return d, 2
                except OSError:
                    continue
    return None


class EnvCgroup:
    """One child memory cgroup; a process joins it by writing ``0`` to ``procs_path`` (as root)."""

    def __init__(self, parent: str, version: int, name: str, memory_bytes: int) -> None:
        self.version = version
        self.memory_bytes = memory_bytes
        self.path = os.path.join(parent, _PREFIX + name)
        self.procs_path = os.path.join(self.path, "cgroup.procs")
        # v1 places single threads (the environment's spawner thread, `sandbox._spawner`)
        self.tasks_path = os.path.join(self.path, "tasks") if version == 1 else None
        os.mkdir(self.path)
        try:
            if version == 1:
                self._write("memory.limit_in_bytes", memory_bytes)
                self._write("memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            else:
                self._write("memory.max", memory_bytes)
                self._write("memory.swap.max", 0, optional=True)
        except BaseException:
            self.remove()
            raise

    def set_limit(self, memory_bytes: int) -> None:
        """Give the cgroup a new limit and a fresh peak (for its next environment).

        Raises:
            OSError: the cgroup cannot be brought under ``memory_bytes`` (charges it keeps).
        """
        if self.version == 1:
            # memory.limit_in_bytes may never exceed memory.memsw.limit_in_bytes
            order = ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes")
            for name in order if memory_bytes > self.memory_bytes else reversed(order):
                self._write(name, memory_bytes, optional=name.startswith("memory.memsw"))
            self._write("memory.max_usage_in_bytes", 0)
        else:
            self._write("memory.max", memory_bytes)
            self._write("memory.peak", 0, optional=True)
        self.memory_bytes = memory_bytes

    def tasks(self) -> set[int]:
        """Thread ids (v1) or process ids (v2) in the cgroup."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        with open(os.path.join(self.path, name), encoding="ascii") as f:
            return {int(line) for line in f if line.strip()}

    def _write(self, name: str, value: int, *, optional: bool = False) -> None:
        path = os.path.join(self.path, name)
        if optional and not os.path.exists(path):
            return
        with open(path, "w", encoding="ascii") as f:
            f.write(str(value))

    def remove(self) -> None:
        """rmdir the cgroup (waits briefly for exiting processes; never raises)."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    break
                time.sleep(0.01)
        log.warning("sandbox_cgroup_not_removed", path=self.path)


class CgroupPool:
    """The memory cgroups of a store's environments, each with its spawner thread, recycled."""

    def __init__(self, parent: str, version: int, max_free: int = 64) -> None:
        self.parent, self.version, self.max_free = parent, version, max_free
        self._free: list[tuple[EnvCgroup, Spawner]] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, memory_bytes: int, name: str) -> tuple[EnvCgroup, Spawner]:
        """A cgroup limited to ``memory_bytes`` and the spawner placed in it (a new one if none is free)."""
        while True:
            with self._lock:
                if not self._free:
                    break
                cgroup, spawner = self._free.pop()
            try:
                cgroup.set_limit(memory_bytes)
                return cgroup, spawner
            except OSError as e:
                log.info("sandbox_cgroup_not_reused", path=cgroup.path, reason=str(e))
                _discard(cgroup, spawner)
        cgroup = EnvCgroup(self.parent, self.version, name, memory_bytes)
        return cgroup, Spawner(cgroup.tasks_path)

    def release(self, cgroup: EnvCgroup, spawner: Spawner) -> None:
        """Take back a closed environment's cgroup: kept if nothing but its spawner is left in it."""
        try:
            clean = spawner.native_id is not None and cgroup.tasks() <= {spawner.native_id}
        except OSError:
            clean = False
        with self._lock:
            if clean and not self._closed and len(self._free) < self.max_free:
                self._free.append((cgroup, spawner))
                return
        _discard(cgroup, spawner)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for cgroup, spawner in free:
            _discard(cgroup, spawner)


def _discard(cgroup: EnvCgroup, spawner: Spawner) -> None:
    spawner.close()
    cgroup.remove()


def probe(store_name: str, uid: int, gid: int) -> tuple[str, int] | None:
    """Check that a forked child can join a child memory cgroup and then drop to the sandbox uid
    (as commands do); returns (parent, version)."""
    found = find_memory_cgroup()
    if found is None:
        log.info("sandbox_memory_cgroup_unavailable", reason="no writable memory cgroup found")
        return None
    parent, version = found
    try:
        cg = EnvCgroup(parent, version, f"{store_name}-probe", 64 << 20)
    except OSError as e:
        log.info("sandbox_memory_cgroup_unavailable", reason=str(e), parent=parent)
        return None
    try:
        result = subprocess.run(
            ["/bin/true"],
            preexec_fn=_child.child_setup(uid, gid, cg.procs_path),
            capture_output=True,
            timeout=10,
            check=False,
            env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.SubprocessError) as e:
        log.info("sandbox_memory_cgroup_unavailable", reason=str(e), parent=parent)
        return None
    finally:
        cg.remove()
    if result.returncode != 0:
        log.info("sandbox_memory_cgroup_unavailable", reason=result.stderr.decode(errors="replace").strip())
        return None
    return parent, version


def reap_stale(parent: str) -> None:
    """Remove our child cgroups whose store (``<pid>-<token>``) is gone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith(_PREFIX):
                continue
            pid = name[len(_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))
