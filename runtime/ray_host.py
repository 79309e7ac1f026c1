"""The Ray actor that runs one actor process on its node (runtime.ray_backend places it).

Standard library (and ray) only: the Ray backend ships this module by value (cloudpickle), so a node needs no
copy of the project to run it; the actor process it starts finds the project's code through the
``PYTHONPATH`` and working directory the backend gives it (a shared image, or Ray's working_dir).

The process is started as the local backend starts it: its own session, SIGKILL when its parent (this
Ray worker) dies, stdout and stderr appended to its output file on this node, the node's environment
(without what Ray sets for its own workers: `RAY_WORKER_ENV`). Ray restarts nothing
(the backend places it with ``max_restarts=0``): the supervisor's policy is the only one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
OUTPUT_TAIL_BYTES = 4000  # the end of a process's output, returned with its exit status
# what Ray sets in the environment of its own worker processes, not the node's: OMP_NUM_THREADS=1 for a worker
# reserving no CPU (it would override a kind's ``threads = 0``, torch's default), its debugger as
# breakpoint(), its internal flags. A process started here has these as its node has them, as a local one has
# runtime.up's.
RAY_WORKER_ENV = ("OMP_NUM_THREADS", "PYTHONBREAKPOINT", "SPT_NOENV", "RAY_JOB_ID", "RAY_RAYLET_PID",
                  "RAY_OVERRIDE_NODE_ID_FOR_TESTING")


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL when this Ray worker dies (runtime.procutil.die_with_parent, without the import)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _node_environment() -> dict[str, str]:
    """This worker's environment with `RAY_WORKER_ENV` as the node has it: as its raylet (this worker's parent,
    started with the node's environment) has it, absent when that cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes().decode(errors="replace")
        node = dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)
    except OSError:
        node = {}
    env = {k: v for k, v in os.environ.items() if k not in RAY_WORKER_ENV}
    env.update({k: node[k] for k in RAY_WORKER_ENV if k in node})
    return env


def _start_in_child(niceness: int) -> None:
    """preexec_fn: die with this worker, and run at the node's own niceness: Ray starts its workers
    niced (``worker_niceness``, +15), which the actor's ``nice`` would otherwise add to and saturate
    at 19, where every kind's ``nice`` is the same. Lowering niceness needs CAP_SYS_NICE: without it
    the worker's niceness stays (still the same for every actor on the node)."""
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, niceness)


class ActorHost:
    """One actor process on this node; an async Ray actor, so wait, signal and kill can overlap."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._output: Path | None = None

    async def start(self, args: list[str], env: dict[str, str], cwd: str, pythonpath: list[str],
                    output_path: str) -> dict[str, Any]:
        """Starts ``<this python> args``; ``pythonpath`` entries relative to this worker's directory (Ray's
        working_dir) are made absolute here. Returns its pid and where it runs."""
        here = os.getcwd()
        paths = [str(Path(here, p)) for p in pythonpath]
        full_env = {**_node_environment(), **env, "PYTHONPATH": os.pathsep.join(paths)}
        node_niceness = os.getpriority(os.PRIO_PROCESS, os.getppid())  # the raylet's, which started this worker
        self._output = Path(output_path)
        self._output.parent.mkdir(parents=True, exist_ok=True)
        with open(self._output, "ab") as out:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, *args, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: _start_in_child(node_niceness),
                env=full_env, cwd=cwd or here)
        import ray  # this is a Ray worker: ray is there, whatever else the node lacks

        return {"pid": self._proc.pid, "hostname": socket.gethostname(), "cwd": cwd or here,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def wait(self) -> dict[str, Any]:
        """Its exit status and the end of its output, once it has exited."""
        assert self._proc is not None, "start first"
        rc = await self._proc.wait()
        return {"returncode": rc, "output_tail": self._tail()}

    def signal(self, sig: int) -> bool:
        """Delivers ``sig``; False when the process has exited already."""
        if self._proc is None or self._proc.returncode is not None:
            return False
        try:
            self._proc.send_signal(sig)
        except ProcessLookupError:
            return False
        return True

    async def kill_session(self) -> int:
        """SIGKILL to the process's whole session (its sandboxes too); its exit status."""
        assert self._proc is not None, "start first"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        return await self._proc.wait()

    def _tail(self) -> str:
        if self._output is None:
            return ""
        try:
            with open(self._output, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - OUTPUT_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError:
            return ""
