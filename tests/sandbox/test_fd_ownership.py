"""Every fd a sandboxed command uses has one owner that closes it once, on either event loop.

The fault guarded against, an evaluator crash (EBADF closing a command's pidfd): under uvloop, the actors'
loop, ``connect_read_pipe``/``connect_write_pipe`` close each command's stdout, stderr and stdin twice
(libuv, then the pipe's file object); a second close that lands on a number another thread was
just given closes that thread's fd: Popen's error pipe in a spawner thread, a command's pidfd, a
socket. The workload (`tests.sandbox._fd_workload`) runs in its own process so that it can run
under uvloop and under strace, which sees every close the kernel refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sandbox
from sandbox import Environment, LayerStore, SandboxLimits

from ._fd_workload import COMM
from .conftest import SANDBOX_UID, TEST_ROOT, sandbox_pids

pytestmark = pytest.mark.usefixtures("host_unchanged")

_WORKLOAD = Path(__file__).with_name("_fd_workload.py")
_SANDBOX_ROOT = str(Path(sandbox.__file__).resolve().parents[1])  # the tree under test, passed on


def _run_workload(loop: str, rounds: int, tracer: list[str] | None = None) -> dict[str, object]:
    argv = [*(tracer or []), sys.executable, str(_WORKLOAD), loop, TEST_ROOT, str(SANDBOX_UID), str(rounds)]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": _SANDBOX_ROOT}, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_no_fd_is_closed_twice(loop: str, store: LayerStore, tmp_path: Path) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (scripts/install_system_deps.sh installs it)")
    trace = tmp_path / "closes"
    tracer = [strace, "-f", "-qq", "-Y", "-e", "trace=close", "-e", "status=failed", "-e", "signal=none"]
    tracer += ["-o", str(trace)]
    report = _run_workload(loop, rounds=1, tracer=tracer)
    assert report == {"commands": 32, "errors": [], "stolen": []}
    # only the workload's own threads: the shells it runs close fds they never opened, their business
    refused = [line for line in trace.read_text().splitlines() if f"<{COMM.decode()}> close(" in line]
    assert refused == [], f"{len(refused)} closes of fds already closed, e.g. {refused[:5]}"


def test_concurrent_commands_leave_other_threads_fds_alone(store: LayerStore) -> None:
    """Without a tracer, as the actors run it: uvloop, spawner threads forking, victim threads."""
    report = _run_workload("uvloop", rounds=3)
    assert report == {"commands": 96, "errors": [], "stolen": []}


async def test_a_command_cancelled_while_starting_leaves_no_process(store: LayerStore) -> None:
    """Cancelled at any point of its start, a command's sandbox is ended as a killed one is: never
    by killing bwrap before it reported its init (an init cloned just then would outlive it,
    orphaned), nor by closing fds the fork has yet to use."""
    survivors = []
    with Environment.create(store, {}, SandboxLimits(wall_time_s=60.0)) as env:
        for delay in (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12) * 2:
            task = asyncio.create_task(env.run("sleep 50 & sleep 60"))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await env.wait_idle(30.0)  # idle means no process of it is left
            if left := sandbox_pids():
                survivors.append((delay, left))
                for pid in left:  # the next round starts clean
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(0.2)
    assert survivors == []
