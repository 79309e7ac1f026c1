"""A workload for the fd-ownership tests, run as its own process (``python -m``), optionally under strace.

Several environments (so several spawner threads fork at once) run commands that end every way a
command can: normally, fed stdin, fed more stdin than they read, killed by the wall clock, cut at
the output cap, cancelled while starting and while running, and still running when their
environment closes. Meanwhile victim threads do what any other thread of an actor does (open fds,
use them, close them) and check that each fd is still the one they opened when they use it: a
double close anywhere in the process that lands on a reused number shows up as a victim's fd
closed under it (EBADF) or replaced (another inode). Prints one JSON line: commands run, errors
the sandbox raised, fds stolen from the victims.

Usage: python -m tests.sandbox._fd_workload LOOP ROOT UID ROUNDS  (LOOP: uvloop or asyncio)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import sys
import threading
import traceback

import uvloop

from sandbox import Environment, LayerStore, SandboxLimits
from sandbox.config import SandboxConfig

COMM = b"fdaudit"  # the process's name, so a trace can tell its threads from the commands it forks
_NUM_ENVS = 4
_NUM_VICTIMS = 2
_LIMITS = SandboxLimits(wall_time_s=10.0, output_bytes=4096)


def _victim(stop: threading.Event, stolen: list[str]) -> None:
    while not stop.is_set():
        read_fd, write_fd = os.pipe()
        opened = (os.fstat(read_fd).st_ino, os.fstat(write_fd).st_ino)
        try:
            os.sched_yield()  # other threads run while these are open
            os.write(write_fd, b"x")
            if (os.fstat(read_fd).st_ino, os.fstat(write_fd).st_ino) != opened or os.read(read_fd, 1) != b"x":
                stolen.append(f"pipe ({read_fd}, {write_fd}) replaced by another file")
                continue  # not ours any more: never close them
        except OSError as e:
            stolen.append(f"pipe ({read_fd}, {write_fd}) closed under its owner: {e}")
            continue
        os.close(read_fd)
        os.close(write_fd)


async def _commands(env: Environment) -> int:
    """Every way a command ends; returns how many ran."""
    results = [
        await env.run("echo out; echo err >&2"),
        await env.run("cat", stdin=b"fed\n"),
        await env.run("head -c 10 >/dev/null", stdin=b"y" * (1 << 18)),  # reads little of a lot
        await env.run("true", stdin=b"z" * (1 << 17)),  # reads none of it
        await env.run("sleep 5", timeout_s=0.2),
        await env.run("yes | head -c 100000; yes | head -c 100000 >&2"),
    ]
    assert results[0].stdout == "out\n" and results[0].stderr == "err\n", results[0]
    assert results[1].stdout == "fed\n", results[1]
    assert results[4].timed_out and results[5].truncated, results[4:]
    for delay in (0.0, 0.3):  # cancelled while starting, then while running
        task = asyncio.create_task(env.run("sleep 5"))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return len(results) + 2


async def _main(root: str, uid: int, rounds: int) -> dict[str, object]:
    stop, stolen, errors = threading.Event(), [], []
    victims = [threading.Thread(target=_victim, args=(stop, stolen), daemon=True) for _ in range(_NUM_VICTIMS)]
    for victim in victims:
        victim.start()
    num_commands = 0
    config = SandboxConfig(root_dir=root, sandbox_uid=uid, sandbox_gid=uid)
    try:
        with LayerStore(config) as store:
            envs = [Environment.create(store, {"f": "1"}, _LIMITS) for _ in range(_NUM_ENVS)]

            async def one(env: Environment) -> None:
                nonlocal num_commands
                for _ in range(rounds):
                    try:
                        ran = await _commands(env)
                        num_commands += ran
                    except Exception as e:  # said in the report, the other environments go on
                        errors.append("".join(traceback.format_exception_only(e)).strip())
                lingering = asyncio.create_task(env.run("sleep 30"))  # still running at close
                await asyncio.sleep(0.2)
                env.close()
                result = await lingering
                assert result.exit_code != 0, result

            try:
                await asyncio.gather(*(one(env) for env in envs))
            finally:
                for env in envs:
                    env.close()
    finally:
        stop.set()
        for victim in victims:
            victim.join()
    return {"commands": num_commands, "errors": errors, "stolen": stolen}


if __name__ == "__main__":
    loop_name, root_dir, sandbox_uid, num_rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ctypes.CDLL(None).prctl(15, COMM, 0, 0, 0)  # PR_SET_NAME; threads made later inherit it
    run = uvloop.run if loop_name == "uvloop" else asyncio.run
    print(json.dumps(run(_main(root_dir, sandbox_uid, num_rounds))), flush=True)
