"""Process plumbing for one sandboxed command: limits prelude, its pipes, termination."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import select
import signal

from sandbox._pipes import PipeReader, PipeWriter, close_all
from sandbox._spawner import SpawnedProcess
from sandbox.config import SandboxLimits

__all__ = ["CommandPipes", "RunningCommand", "ulimit_prelude"]

_INFO_CAP = 1 << 12  # bwrap's info is one small JSON object
_REAP_TIMEOUT_S = 5.0
_CHILD_PID_RE = re.compile(rb'"child-pid"\s*:\s*(\d+)')


class CommandPipes:
    """One command's pipes: stdout and stderr (kept up to ``output_cap`` bytes each), stdin (fed
    ``stdin``, when given) and bwrap's info pipe (``--info-fd``). The child's ends go to the spawn."""

    def __init__(self, output_cap: int, stdin: bytes | None) -> None:
        with contextlib.ExitStack() as undo:  # a pipe that cannot be made closes those made before it
            self.info = PipeReader(_INFO_CAP)
            undo.callback(self.info.close)
            self.stdout = PipeReader(output_cap)
            undo.callback(self.stdout.close)
            self.stderr = PipeReader(output_cap)
            undo.callback(self.stderr.close)
            self.stdin = PipeWriter(stdin) if stdin is not None else None
            undo.pop_all()
        self._all = tuple(p for p in (self.info, self.stdout, self.stderr, self.stdin) if p is not None)

    async def wait(self) -> None:
        """Until the command closed its stdout and stderr and took all of its stdin."""
        await asyncio.gather(*(pipe.wait() for pipe in (self.stdout, self.stderr, self.stdin) if pipe is not None))

    def close(self) -> None:
        """Close every pipe's ends still held here (idempotent; each is tried, the first error raised)."""
        error: BaseException | None = None
        for pipe in self._all:
            try:
                pipe.close()
            except OSError as e:
                error = error or e
        if error is not None:
            raise error


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

    bwrap reports its child's host pid (the sandbox's pid 1) on its info pipe right after cloning
    it; the pidfd is opened as soon as the report arrives, and kept only if that process's
    parent is our bwrap, which we have not reaped, so a recycled pid is never the target.
    Killing the init (pid 1 of its pid namespace) makes the kernel kill every process in the
    namespace; a kill asked for before the init is known happens when bwrap reports it.
    """

    def __init__(self, proc: SpawnedProcess, pipes: CommandPipes) -> None:
        self.proc = proc
        self.pipes = pipes  # this command's now: closed by `terminate` or `close`
        self._bwrap_pidfd = _pidfd(proc.pid)  # our unreaped child: its pid is still its own
        self._init_pidfd: int | None = None
        self._kill_wanted = False
        self._loop = asyncio.get_running_loop()
        self._init_watch = asyncio.Lock()
        # the info pipe closes itself at end of file, not before: bwrap writes more after the pid,
        # and a closed pipe would SIGPIPE it
        pipes.info.on_data = self._find_init
        self._find_init()  # what arrived while the fork returned

    def _find_init(self) -> None:
        match = _CHILD_PID_RE.search(self.pipes.info.data)  # bwrap may write it in pieces
        if match and self._init_pidfd is None:
            pid = int(match.group(1))
            pidfd = _pidfd(pid)
            if pidfd is not None and _parent_pid(pidfd, pid) == self.proc.pid:
                self._init_pidfd = pidfd
                if self._kill_wanted:
                    _send(pidfd, signal.SIGKILL)
            elif pidfd is not None:
                os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL the sandbox's init, and so its pid namespace.

        Before bwrap has reported the init, the kill waits for the report: bwrap killed then
        could leave the init it had just cloned alive (not yet bound to bwrap's death), orphaned
        and out of reach. `terminate` bounds the wait.
        """
        self._kill_wanted = True
        self.pipes.info.read_available()  # a report already in the pipe kills at once
        if self._init_pidfd is not None:
            _send(self._init_pidfd, signal.SIGKILL)

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

    async def wait_init_exit(self) -> None:
        """Until the sandbox's init has exited (unbounded: the caller bounds it). Waiters take
        turns on the pidfd's one reader, so none removes another's."""
        async with self._init_watch:
            if self._init_pidfd is None or self.init_exited():
                return
            exited = self._loop.create_future()
            self._loop.add_reader(self._init_pidfd, lambda: exited.done() or exited.set_result(None))
            try:
                await exited
            finally:
                self._loop.remove_reader(self._init_pidfd)

    async def _wait_init_exit(self) -> bool:
        try:
            await asyncio.wait_for(self.wait_init_exit(), _REAP_TIMEOUT_S)
        except TimeoutError:
            return False
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
            except TimeoutError:  # no init reported, or it does not die: bwrap as the last resort
                _send(self._bwrap_pidfd, signal.SIGKILL)
                try:
                    await asyncio.wait_for(self.proc.wait(), _REAP_TIMEOUT_S)
                except TimeoutError:
                    return False  # (reaped whenever it exits: its pidfd stays watched)
            return await self._wait_init_exit()
        finally:
            self.pipes.close()

    def close(self) -> None:
        """Release the pipes and pidfds (after `terminate`, or for a command given up on; idempotent).

        Each fd here is this command's alone, so a failing close (EBADF) is a bug elsewhere that
        closed a number it did not own: raised, never hidden.
        """
        pidfds = tuple(fd for fd in (self._init_pidfd, self._bwrap_pidfd) if fd is not None)
        self._init_pidfd = self._bwrap_pidfd = None
        try:
            self.pipes.close()
        finally:
            close_all(pidfds)
