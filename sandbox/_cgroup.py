"""Optional per-environment memory cgroup (v1 or v2), capping the sum over all of its processes.

RLIMIT_AS bounds each process; a cgroup bounds their total (and the tmpfs pages they write).
It is used when this process may create a child of its own memory cgroup and move a forked
child into it (checked once by `probe`); otherwise sandboxes fall back to rlimits alone and
`probe` says why. The cgroup is made once per environment; each command's forked child joins it
while still root, before it drops to the sandbox uid and executes bwrap (`sandbox._child`), so
no shell is started per command and the sandbox uid owns no cgroup file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time

import structlog

from sandbox import _child

__all__ = ["EnvCgroup", "find_memory_cgroup", "probe", "reap_stale"]

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
