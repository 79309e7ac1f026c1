"""Process plumbing for one sandboxed command: limits prelude, capped output, termination."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import select
import signal

import structlog

from sandbox._spawner import SpawnedProcess
from sandbox.config import SandboxLimits

__all__ = ["CappedReader", "RunningCommand", "ulimit_prelude"]

log = structlog.get_logger(__name__)

_READ_CHUNK = 1 << 16
_REAP_TIMEOUT_S = 5.0
_CHILD_PID_RE = re.compile(rb'"child-pid"\s*:\s*(\d+)')


class CappedReader:
    """Drains a pipe to EOF, keeping the first ``cap`` bytes."""

    def __init__(self, stream: asyncio.StreamReader, cap: int) -> None:
        self.stream, self.cap = stream, cap
        self.data = bytearray()
        self.truncated = False

    async def drain(self) -> None:
        while chunk := await self.stream.read(_READ_CHUNK):
            room = self.cap - len(self.data)
            if len(chunk) > room:
                self.truncated = True
                self.data += chunk[: max(room, 0)]
            else:
                self.data += chunk


def _clamp_to_hard(resource_id: int, value: int) -> int:
    hard = resource.getrlimit(resource_id)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def ulimit_prelude(limits: SandboxLimits) -> str:
    # bash units: -v and -f in KiB; -t seconds; -u and -n counts. Sets soft and hard limits.
    cpu = _clamp_to_hard(resource.RLIMIT_CPU, limits.cpu_time_s)
    mem_kib = _clamp_to_hard(resource.RLIMIT_AS, limits.memory_bytes) // 1024
    fsize_kib = max(_clamp_to_hard(resource.RLIMIT_FSIZE, limits.file_size_bytes) // 1024, 1)
    nproc = _clamp_to_hard(resource.RLIMIT_NPROC, limits.num_processes)
    nofile = _clamp_to_hard(resource.RLIMIT_NOFILE, limits.num_open_files)
    return (
        f"ulimit -c 0 -t {cpu} -v {mem_kib} -f {fsize_kib} -u {nproc} -n {nofile} "
        "|| { echo 'sandbox: cannot apply limits' >&2; exit 126; }\n"
    )


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None


def _parent_pid(pidfd: int, pid: int) -> int | None:
    """The parent of the process behind ``pidfd`` (read through its numeric pid, then checked to
    still be that process, so a recycled pid reads as None)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        signal.pidfd_send_signal(pidfd, 0)  # still alive, so /proc/{pid} was this process
    except (OSError, IndexError):
        return None
    return int(fields[1])


def _send(pidfd: int | None, sig: int) -> None:
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)


class RunningCommand:
    """A started bwrap and its sandbox's init, both held by pidfds (never signalled by number).

    bwrap reports its child's host pid (the sandbox's pid 1) on ``info_fd`` right after cloning
    it; the pidfd is opened as soon as the report arrives, and kept only if that process's
    parent is our bwrap, which we have not reaped, so a recycled pid is never the target.
    Killing the init (pid 1 of its pid namespace) makes the kernel kill every process in the
    namespace; before the init is known, killing bwrap does it (``--die-with-parent``).
    """

    def __init__(self, proc: SpawnedProcess, info_fd: int) -> None:
        self.proc = proc
        self._bwrap_pidfd = _pidfd(proc.pid)  # our unreaped child: its pid is still its own
        self._init_pidfd: int | None = None
        self._info_fd: int | None = info_fd
        self._info = b""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(info_fd, self._read_info)

    def _read_info(self) -> None:
        if self._info_fd is None:
            return
        eof = False
        try:
            while chunk := os.read(self._info_fd, 4096):  # bwrap may write it in pieces
                self._info += chunk
            eof = True
        except BlockingIOError:
            pass
        except OSError:
            eof = True
        match = _CHILD_PID_RE.search(self._info)
        if match and self._init_pidfd is None:
            pid = int(match.group(1))
            pidfd = _pidfd(pid)
            if pidfd is not None and _parent_pid(pidfd, pid) == self.proc.pid:
                self._init_pidfd = pidfd
            elif pidfd is not None:
                os.close(pidfd)
        if eof:  # not before: bwrap writes more after the pid, and a closed pipe would SIGPIPE it
            self._close_info()

    def _close_info(self) -> None:
        if self._info_fd is not None:
            self._loop.remove_reader(self._info_fd)
            os.close(self._info_fd)
            self._info_fd = None

    def kill(self) -> None:
        """SIGKILL the sandbox's init (and so its pid namespace); before it is known, bwrap."""
        self._read_info()
        if self._init_pidfd is not None:
            _send(self._init_pidfd, signal.SIGKILL)
        elif self.proc.returncode is None:
            _send(self._bwrap_pidfd, signal.SIGKILL)

    def init_exited(self) -> bool:
        """Whether the sandbox's init is known to be gone (its pid namespace then is empty)."""
        if self._init_pidfd is None:
            return self.proc.returncode is not None
        try:
            signal.pidfd_send_signal(self._init_pidfd, 0)
        except ProcessLookupError:
            return True
        # a zombie still accepts signal 0: it has exited when its pidfd reads as ready
        return bool(select.select([self._init_pidfd], [], [], 0)[0])

    async def _wait_init_exit(self) -> bool:
        if self._init_pidfd is None or self.init_exited():
            return True
        exited = self._loop.create_future()
        self._loop.add_reader(self._init_pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, _REAP_TIMEOUT_S)
        except TimeoutError:
            return False
        finally:
            self._loop.remove_reader(self._init_pidfd)
        return True

    async def terminate(self) -> bool:
        """Kill if still running; True once the sandbox's pid namespace is known to be empty.

        False means a sandbox process may still be alive after the kill and the reap timeout:
        the caller must treat the workspace as in use (see `Environment.snapshot`).
        """
        try:
            self.kill()
            try:
                await asyncio.wait_for(self.proc.wait(), _REAP_TIMEOUT_S)
            except TimeoutError:
                _send(self._bwrap_pidfd, signal.SIGKILL)
                try:
                    await asyncio.wait_for(self.proc.wait(), _REAP_TIMEOUT_S)
                except TimeoutError:
                    return False  # (reaped whenever it exits: its pidfd stays watched)
            return await self._wait_init_exit()
        finally:
            self._close_info()

    def close(self) -> None:
        """Release the pidfds (after `terminate`, or for a command given up on)."""
        self._close_info()
        for fd in (self._init_pidfd, self._bwrap_pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError as e:  # seen once in CI (EBADF): said, not raised into the command's caller
                    log.error("sandbox_pidfd_close_failed", fd=fd, error=repr(e),
                              note="a pidfd was closed elsewhere first; please report with this log")
        self._init_pidfd = self._bwrap_pidfd = None
