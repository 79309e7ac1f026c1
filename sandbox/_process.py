"""Process plumbing for one sandboxed command: limits prelude, capped output, termination."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import signal

import structlog

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


class RunningCommand:
    """A started bwrap and the fd on which it reports its sandbox init's host pid.

    Killing the sandbox's init (pid 1 of its pid namespace) makes the kernel kill every process
    in the namespace, and init only finishes exiting once they are all gone. The outer bwrap
    learns init's status through an eventfd and may exit first, so we also wait (on a pidfd)
    for init itself to exit; it then lingers only as a zombie until the host's pid 1 reaps it.
    """

    def __init__(self, proc: asyncio.subprocess.Process, info_fd: int) -> None:
        self.proc = proc
        self._info_fd: int | None = info_fd
        self._info = b""
        self._child_pid: int | None = None

    def _read_child_pid(self) -> int | None:
        if self._child_pid is None and self._info_fd is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                while chunk := os.read(self._info_fd, 4096):  # bwrap may write it in pieces
                    self._info += chunk
            match = _CHILD_PID_RE.search(self._info)
            if match:
                self._child_pid = int(match.group(1))
        return self._child_pid

    async def _wait_init_exit(self) -> None:
        pid = self._read_child_pid()
        if pid is None:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, _REAP_TIMEOUT_S)
        except TimeoutError:
            log.warning("sandbox_init_exit_slow", pid=pid)
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL the sandbox's init (or, before it exists, bwrap's process group)."""
        if self.proc.returncode is not None:
            return
        pid = self._read_child_pid()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def terminate(self) -> None:
        """Kill if still running; return once the sandbox's pid namespace is empty."""
        try:
            self.kill()
            try:
                await asyncio.wait_for(self.proc.wait(), _REAP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
            await self._wait_init_exit()
        finally:
            if self._info_fd is not None:
                os.close(self._info_fd)
                self._info_fd = None
