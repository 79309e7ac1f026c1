"""The local backend's zygote: one process per run that imports the actors' modules (torch among them) once and
forks every actor process from there, where a fresh interpreter would import them again (3 to 5 CPU-seconds an
actor, most of the cost of a run's start on a small machine).

    python -m runtime.zygote --preload MODULE,... --room PADDING      (started by `Zygote.start`)

The zygote is single-threaded and has no event loop: a fork copies only the forking thread, so a process
that forks must hold no lock another thread could own. It reads one JSON request a line on its stdin
(``{"id", "args", "env", "cwd", "output"}``) and answers on its stdout: ``{"id", "pid"}`` once the child
has its own session, or ``{"id", "error"}`` (with ``"retired": true`` when it forks nothing more); then
``{"exited": pid, "returncode": rc}`` when it reaps a child (negative: the signal that killed it, as
``asyncio.subprocess.Process.returncode``). A child is what ``python -m runtime.actor_process ARGS`` with
``env`` would be: its own session, SIGKILL on its parent's death (the zygote's, itself killed with
``runtime.up``), stdin from /dev/null, its output appended to ``output``, the environment and command line
written over the zygote's own (so ``/proc/<pid>/environ`` and ``cmdline`` show the actor's, as for a
spawned process), torch's threads set from ``OMP_NUM_THREADS``.

A zygote whose imported files changed on disk since it loaded them (a hot swap's new code) answers
``{"id", "error", "stale": true, "retired": true}`` and forks nothing more (a child must run the code on
disk, as a spawned one does): it goes on reaping its children, which die with it, until they have all
exited; the backend then closes it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from runtime.procutil import die_with_parent

__all__ = ["ROOM_ENV", "Zygote", "ZygoteChild", "ZygoteUnavailable", "main"]

log = structlog.get_logger(__name__)

ROOM_ENV = "RUNTIME_ZYGOTE_ROOM"  # padding in the zygote's environment: room for a child's own
ENV_ROOM = 32 * 1024  # bytes of environment a child may have beyond the zygote's
ARGV_ROOM = 4 * 1024  # bytes of command line a child may have beyond the zygote's
READY_TIMEOUT_S = 300.0  # its imports, on a loaded machine (torch: 20 s of wall time beside a CPU hog)
FORK_TIMEOUT_S = 60.0  # a fork and a child's setsid, on a loaded machine
CLOSE_TIMEOUT_S = 10.0


class ZygoteUnavailable(RuntimeError):
    """The zygote cannot fork this process (it died, changed code, or never started): start it plainly."""


# --- the zygote process ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Request:
    id: int
    args: tuple[str, ...]  # after the interpreter: ("-m", module, ...)
    env: dict[str, str]
    cwd: str
    output: str


def _write(fd: int, message: Mapping[str, Any]) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _loaded_files() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every loaded module's source outside the interpreter's installation: what a
    change on disk makes stale."""
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or path.startswith(installed) or "site-packages" in path:
            continue
        with contextlib.suppress(OSError):
            st = os.stat(path)
            out[path] = (st.st_mtime_ns, st.st_size)
    return out


def _changed(files: Mapping[str, tuple[int, int]]) -> str | None:
    for path, seen in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != seen:
            return path
    return None


def _memory_regions() -> tuple[int, int, int, int]:
    """arg_start, arg_end, env_start, env_end of this process (proc(5): fields 48 to 51 of /proc/self/stat)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[45]), int(fields[46]), int(fields[47]), int(fields[48])


def _overwrite(start: int, end: int, strings: Sequence[str]) -> bool:
    """``strings``, NUL-terminated, over the memory ``[start, end)`` (the rest zeroed); False if they do not fit."""
    blob = b"".join(s.encode() + b"\0" for s in strings)
    if len(blob) > end - start:
        return False
    ctypes.memmove(start, blob + b"\0" * (end - start - len(blob)), end - start)
    return True


def _become(request: _Request, zygote_pid: int) -> None:
    """In the forked child: the session, output, directory, environment and command line of the process
    ``request`` describes. Once the environment is replaced no string of the zygote's is referenced, so its
    memory can carry the child's (what ``/proc/<pid>/environ`` reads)."""
    os.setsid()
    die_with_parent()
    if os.getppid() != zygote_pid:  # the zygote died before the parent-death signal was armed
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    argv = [sys.executable, *request.args]
    arg_start, arg_end, env_start, env_end = _memory_regions()
    if not (_overwrite(env_start, env_end, [f"{k}={v}" for k, v in request.env.items()])
            and _overwrite(arg_start, arg_end, argv)):
        os.execve(sys.executable, argv, request.env)  # too big for the room: this one process starts plainly
    threads = request.env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))  # torch read its variables in the zygote


def _fork(request: _Request, channels: tuple[int, ...], zygote_pid: int) -> int:
    """Forks the child of ``request``; returns its pid once it has its own session (0 in the child).

    Raises:
        OSError: the child could not be set up (its reason).
    """
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in channels:
                os.close(fd)
            _become(request, zygote_pid)
        except BaseException as e:
            os.write(ready_w, repr(e).encode()[:4000])
            os._exit(127)
        os.close(ready_w)
        return 0
    os.close(ready_w)
    failure = b""
    while chunk := os.read(ready_r, 4096):  # EOF: the child closed it (set up) or exited
        failure += chunk
    os.close(ready_r)
    if failure:
        raise OSError(f"the forked process could not start: {failure.decode(errors='replace')}")
    return pid


def _reap(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write(replies, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _serve(requests: int, replies: int) -> _Request | None:
    """Answers requests until its parent closes them (None), or returns a forked child's request (in the child)."""
    zygote_pid = os.getpid()
    files = _loaded_files()
    # what is imported stays shared with the children: their collections leave it untouched (no copy on write)
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is written on each; reaping happens below
    _write(replies, {"ready": zygote_pid})
    pending = b""
    retired: dict[str, Any] | None = None  # why it forks nothing more
    while True:
        readable, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap(replies)
        if requests not in readable:
            continue
        chunk = os.read(requests, 65536)
        if not chunk:
            return None
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = _Request(**{**json.loads(line), "args": tuple(json.loads(line)["args"])})
            if retired is None and (stale := _changed(files)) is not None:
                retired = {"error": f"{stale} changed since the zygote loaded it", "stale": True}
            # Python threads only: native pools (OpenBLAS's, torch's) re-create theirs after a fork (pthread_atfork)
            if retired is None and threading.active_count() > 1:
                retired = {"error": "the zygote has threads (an import started them): a fork would copy the "
                                    "locks they hold", "stale": False}
            if retired is not None:  # it forks nothing more, and reaps its children until it is closed
                _write(replies, {"id": request.id, **retired, "retired": True})
                continue
            try:
                pid = _fork(request, (requests, replies, wake_r, wake_w), zygote_pid)
            except OSError as e:
                _write(replies, {"id": request.id, "error": str(e)})
                continue
            if pid == 0:
                return request
            _write(replies, {"id": request.id, "pid": pid})


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    preload = args[args.index("--preload") + 1].split(",") if "--preload" in args else []
    requests, replies = os.dup(0), os.dup(1)  # stdin/stdout become /dev/null and the log: prints go there
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    for module in filter(None, preload):
        try:
            __import__(module)
        except Exception as e:  # a child importing it fails the same way, in its own output, as a spawned one
            print(f"zygote: {module} not preloaded: {e!r}", file=sys.stderr, flush=True)
    request = _serve(requests, replies)
    if request is None:
        return
    module = request.args[1]
    sys.modules.pop(module, None)  # run as __main__, as `python -m` does, on the modules already imported
    sys.argv = [module, *request.args[2:]]
    import runpy

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        _leave(e.code)
    except BaseException:
        traceback.print_exc()
        _leave(1)
    _leave(0)


def _leave(code: object) -> None:
    """Ends a forked child as the interpreter would, without tearing the zygote's heap down: its threads joined
    (thread pools' workers told to end first), its exit functions run and its streams flushed, then ``os._exit``,
    as multiprocessing ends a forked child. The interpreter's own teardown would collect every object the zygote
    imported, frozen out of the collections (torch's, triton's): 0.5 CPU-seconds an actor (a whole run's worth
    of its actors' exits on a small machine), and nanobind would report triton's objects leaked."""
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, exit status 1
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does first at its exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code or 0)


# --- the backend's side ---------------------------------------------------------------------------------

class ZygoteChild:
    """A process the zygote forked (the part of ``asyncio.subprocess.Process`` a LocalProcess uses): its exit
    status comes from the zygote, which reaps it; if the zygote dies, its children die with it (SIGKILL)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def send_signal(self, sig: signal.Signals) -> None:
        if self._exit.done():
            raise ProcessLookupError(f"process {self.pid} has exited")
        os.kill(self.pid, sig)

    def _exited(self, returncode: int) -> None:
        if not self._exit.done():
            self._exit.set_result(returncode)

    async def _killed_with_zygote(self) -> None:
        """Waits for the process to be gone (it was sent SIGKILL as the zygote died), then says so."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._exited(-signal.SIGKILL)
            return
        gone = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, gone.set)
        try:
            await gone.wait()  # a pidfd is readable once its process has exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        self._exited(-signal.SIGKILL)


class Zygote:
    """The zygote process of one backend, and the children it forked."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self._children: dict[int, ZygoteChild] = {}
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._reader: asyncio.Task[None] | None = None
        self.stale = False  # it forks nothing more as its code changed on disk
        self._retired = False  # it said it forks nothing more: closed once its last child has exited

    @classmethod
    async def start(cls, preload: Sequence[str], log_path: Path) -> Zygote:
        """A zygote that has imported ``preload`` (a module that fails to import is left to its children).

        Raises:
            ZygoteUnavailable: it exited or did not answer within READY_TIMEOUT_S.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, ROOM_ENV: "x" * ENV_ROOM}
        with open(log_path, "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "runtime.zygote", "--preload", ",".join(preload), "--room", "x" * ARGV_ROOM,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=out,
                start_new_session=True, preexec_fn=die_with_parent, env=env)
        zygote = cls(proc)
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                assert proc.stdout is not None
                line = await proc.stdout.readline()
            if not line or "ready" not in json.loads(line):
                raise ZygoteUnavailable(f"the zygote exited while importing {list(preload)} (see {log_path})")
        except (TimeoutError, ValueError, ZygoteUnavailable) as e:
            await zygote.close()
            raise ZygoteUnavailable(str(e) or f"the zygote was not ready within {READY_TIMEOUT_S}s") from None
        zygote._reader = asyncio.get_running_loop().create_task(zygote._read())
        return zygote

    @property
    def running(self) -> bool:
        """Its process has not exited (retired or not)."""
        return self._proc.returncode is None

    @property
    def alive(self) -> bool:
        """It forks: running, and not retired."""
        return (not self._retired and self._proc.returncode is None and self._reader is not None
                and not self._reader.done())

    async def fork(self, args: Sequence[str], env: Mapping[str, str], output: Path) -> ZygoteChild:
        """The child that runs ``python ARGS`` (``args[:2] == ("-m", module)``) with ``env``, output to ``output``.

        Raises:
            ZygoteUnavailable: the zygote is gone or retired (stale), or did not answer.
            OSError: the child could not be set up (the reason).
        """
        if not self.alive or self._proc.stdin is None:
            raise ZygoteUnavailable("the zygote has exited")
        self._next_id += 1
        request_id = self._next_id
        reply = self._replies[request_id] = asyncio.get_running_loop().create_future()
        request = {"id": request_id, "args": list(args), "env": dict(env), "cwd": os.getcwd(),
                   "output": str(output)}
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            async with asyncio.timeout(FORK_TIMEOUT_S):
                await self._proc.stdin.drain()
                answer = await reply
        except (TimeoutError, ConnectionError) as e:
            raise ZygoteUnavailable(f"the zygote did not fork: {e!r}") from None
        finally:
            self._replies.pop(request_id, None)
        if "pid" in answer:
            return answer["child"]
        if answer.get("retired") or not self.alive:
            self._retired = True
            self.stale = bool(answer.get("stale"))
            self._close_when_childless()
            raise ZygoteUnavailable(answer.get("error", "the zygote has exited"))
        raise OSError(answer["error"])

    async def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            while line := await self._proc.stdout.readline():
                message = json.loads(line)
                if "exited" in message:
                    if child := self._children.pop(message["exited"], None):
                        child._exited(message["returncode"])
                    self._close_when_childless()
                    continue
                if "pid" in message:  # tracked before the next line is read: it may say the child has exited
                    message["child"] = self._children[message["pid"]] = ZygoteChild(message["pid"])
                if (reply := self._replies.get(message.get("id", -1))) is not None and not reply.done():
                    reply.set_result(message)
        finally:
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_result({"error": "the zygote has exited", "retired": True})
            orphans = list(self._children.values())
            self._children.clear()
            if orphans:
                log.warning("zygote_exited", num_children=len(orphans), pid=self._proc.pid,
                            returncode=self._proc.returncode)
            await asyncio.gather(*(child._killed_with_zygote() for child in orphans))

    def _close_when_childless(self) -> None:
        """A retired zygote ends (its input closed) once no child of it runs: they die with it."""
        if self._retired and not self._children and self._proc.stdin is not None:
            self._proc.stdin.close()

    async def close(self) -> None:
        """Ends the zygote (its children have exited by then; any left die with it)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


if __name__ == "__main__":
    main()
