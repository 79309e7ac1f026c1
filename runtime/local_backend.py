"""The local placement backend: each actor process a subprocess of ``runtime.up`` on this machine.

Children run in their own sessions with a parent-death signal: no orphans, ever. Its output goes to
``<run dir>/logs/<actor id>.out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

from runtime.placement import ActorLaunch
from runtime.procutil import die_with_parent
from runtime.run_config import ActorSpec, RuntimeConfig

__all__ = ["LocalBackend", "LocalProcess"]


class LocalProcess:
    """A subprocess of this one (runtime.placement.PlacedProcess)."""

    node = "local"
    lost: str | None = None  # a subprocess cannot lose its node without this process going too

    def __init__(self, proc: asyncio.subprocess.Process, launch: ActorLaunch) -> None:
        self._proc = proc
        self._launch = launch

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def send_signal(self, sig: signal.Signals) -> None:
        self._proc.send_signal(sig)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        await self._proc.wait()

    def output_tail(self) -> str:
        return str(self._launch.output_path)


class LocalBackend:
    async def start(self, launch: ActorLaunch, spec: ActorSpec) -> LocalProcess:
        env = {**os.environ, **launch.env}
        launch.output_path.parent.mkdir(parents=True, exist_ok=True)
        with open(launch.output_path, "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *launch.args,
                stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
                env=env)
        return LocalProcess(proc, launch)

    def check(self, config: RuntimeConfig) -> None:
        """Every kind runs here: nothing to check."""

    async def close(self) -> None:
        """Nothing held: the processes are this one's children."""
