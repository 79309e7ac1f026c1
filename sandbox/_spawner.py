"""Where an environment's commands are forked from: one thread that lives in its memory cgroup.

Moving a process into a cgroup (a write to ``cgroup.procs``) takes the kernel's cgroup
threadgroup lock for writing, which waits for an RCU grace period: ~10 ms on a loaded 2-core
host, about twice a bare bwrap, paid by every command that joins its environment's cgroup after
the fork. A child is born in the cgroup of the *thread* that forks it, so each environment gets
one spawner thread, moved into its cgroup once (cgroup v1 places threads one by one), and every
command is forked there: no migration per command. On cgroup v2 a memory cgroup holds whole
processes only, so there the forked child still joins in ``preexec_fn`` (`sandbox._child`).

The child is a plain `subprocess.Popen` driven from the event loop: its pipes through
``connect_read_pipe``/``connect_write_pipe``, its exit through a pidfd, reaped with ``waitpid``
(no child watcher involved, so it works the same under asyncio's loop and uvloop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["SpawnedProcess", "Spawner"]


def _kill(popen: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        pidfd = os.pidfd_open(popen.pid)  # not reaped yet: still its own pid
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)


def _kill_started(started: asyncio.Future[subprocess.Popen[bytes]]) -> None:
    if not started.cancelled() and started.exception() is None:
        _kill(started.result())


class SpawnedProcess:
    """The parts of `asyncio.subprocess.Process` a sandbox command uses, for a Popen child."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: asyncio.StreamWriter | None,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._pidfd = os.pidfd_open(self.pid)  # unreaped child: the pid is still its own
        self._exited = self._loop.create_future()
        self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        self._popen.returncode = self.returncode  # so Popen never waits for it again
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class Spawner:
    """Forks an environment's commands from one thread, placed in ``tasks_path``'s cgroup (if any)."""

    def __init__(self, tasks_path: str | None) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")
        self.native_id: int | None = None  # the thread's id, once placed
        self.placed = self._executor.submit(self._place, tasks_path) if tasks_path is not None else None

    def _place(self, tasks_path: str) -> None:
        native_id = threading.get_native_id()
        with open(tasks_path, "w", encoding="ascii") as f:
            f.write(str(native_id))
        self.native_id = native_id

    async def in_cgroup(self) -> bool:
        """Whether children forked here are born in the cgroup (waits for the one-time move)."""
        if self.placed is None:
            return False
        try:
            await asyncio.wrap_future(self.placed)
        except OSError:
            return False
        return True

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        with_stdin: bool,
        env: Mapping[str, str],
        preexec_fn: Callable[[], None],
        pass_fds: tuple[int, ...],
    ) -> SpawnedProcess:
        loop = asyncio.get_running_loop()
        started = loop.run_in_executor(
            self._executor,
            functools.partial(
                subprocess.Popen,
                list(argv),
                stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(env),
                cwd="/",
                preexec_fn=preexec_fn,
                start_new_session=True,
                pass_fds=pass_fds,
            ),
        )
        try:
            popen = await asyncio.shield(started)
        except asyncio.CancelledError:  # the fork happens all the same: kill what it starts
            started.add_done_callback(_kill_started)
            raise
        try:
            stdout, stderr = asyncio.StreamReader(), asyncio.StreamReader()
            assert popen.stdout is not None and popen.stderr is not None
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), popen.stdout)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stderr), popen.stderr)
            stdin = None
            if popen.stdin is not None:
                transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
                stdin = asyncio.StreamWriter(transport, protocol, None, loop)
            return SpawnedProcess(popen, stdin, stdout, stderr)
        except BaseException:
            _kill(popen)
            raise

    def close(self) -> None:
        """Let the thread end (it holds nothing; its cgroup can be removed once it has)."""
        self._executor.shutdown(wait=True)
