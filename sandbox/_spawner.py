"""Where an environment's commands are forked from: one thread that lives in its memory cgroup.

Moving a process into a cgroup (a write to ``cgroup.procs``) takes the kernel's cgroup
threadgroup lock for writing, which waits for an RCU grace period: ~10 ms on a loaded 2-core
host, about twice a bare bwrap, paid by every command that joins its environment's cgroup after
the fork. A child is born in the cgroup of the *thread* that forks it, so each environment gets
one spawner thread, moved into its cgroup once (cgroup v1 places threads one by one), and every
command is forked there: no migration per command. On cgroup v2 a memory cgroup holds whole
processes only, so there the forked child still joins in ``preexec_fn`` (`sandbox._child`).

The child is a plain `subprocess.Popen` driven from the event loop: its exit through a pidfd,
reaped with ``waitpid`` (no child watcher involved, so it works the same under asyncio's loop and
uvloop). Its standard streams are pipe ends the caller made (`sandbox._pipes`): Popen holds no file
object of them, so nothing but their owners ever closes them. The child's ends are the spawn's
own until the fork has used them: closed when Popen returns, also when the caller was cancelled
meanwhile (closed earlier, their numbers could be reused and handed to the child in their place).
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

from sandbox._pipes import close_all

__all__ = ["SpawnedProcess", "Spawner"]


def _kill(popen: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        pidfd = os.pidfd_open(popen.pid)  # not reaped yet: still its own pid
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)


def _watched(popen: subprocess.Popen[bytes]) -> SpawnedProcess:
    try:
        return SpawnedProcess(popen)
    except BaseException:
        _kill(popen)  # no pidfd to watch it by: nothing better left than killing it now
        raise


def _hand_over(
    on_abandoned: Callable[[SpawnedProcess | None], None], started: asyncio.Future[subprocess.Popen[bytes]]
) -> None:
    if started.cancelled() or started.exception() is not None:
        on_abandoned(None)
    else:
        on_abandoned(_watched(started.result()))


class SpawnedProcess:
    """The parts of `asyncio.subprocess.Process` a sandbox command uses, for a Popen child."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
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
        stdin: int | None,
        stdout: int,
        stderr: int,
        env: Mapping[str, str],
        preexec_fn: Callable[[], None],
        pass_fds: tuple[int, ...],
        on_abandoned: Callable[[SpawnedProcess | None], None],
    ) -> SpawnedProcess:
        """Fork ``argv`` with these fds as its stdin (None: /dev/null), stdout, stderr and extra fds.

        Takes ownership of every fd given: each is closed once the fork has used it (or failed),
        also when the caller is cancelled meanwhile. The fork happens all the same then: what it
        started (None if nothing) goes to ``on_abandoned``, to be ended like any command.
        """
        loop = asyncio.get_running_loop()
        child_fds = (*((stdin,) if stdin is not None else ()), stdout, stderr, *pass_fds)
        try:
            started = loop.run_in_executor(
                self._executor,
                functools.partial(
                    subprocess.Popen,
                    list(argv),
                    stdin=subprocess.DEVNULL if stdin is None else stdin,
                    stdout=stdout,
                    stderr=stderr,
                    env=dict(env),
                    cwd="/",
                    preexec_fn=preexec_fn,
                    start_new_session=True,
                    pass_fds=pass_fds,
                ),
            )
        except BaseException:
            close_all(child_fds)
            raise
        started.add_done_callback(lambda _: close_all(child_fds))  # runs before this coroutine resumes
        try:
            popen = await asyncio.shield(started)
        except asyncio.CancelledError:
            started.add_done_callback(functools.partial(_hand_over, on_abandoned))
            raise
        return _watched(popen)

    def close(self) -> None:
        """Let the thread end (it holds nothing; its cgroup can be removed once it has)."""
        self._executor.shutdown(wait=True)
