"""The local placement backend: each actor process a subprocess of ``runtime.up`` on this machine.

Children run in their own sessions with a parent-death signal: no orphans, ever. Its output goes to
``<run dir>/logs/<actor id>.out``. They are forked from the run's zygote (`runtime.zygote`), which has
imported the actors' modules once. A zygote that forks nothing more (killed, or its code changed on
disk: it then ends once its children have) is replaced at the next start; a process that cannot be
forked is started plainly (``python -m runtime.actor_process``), as is every one once a zygote could
not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from runtime.placement import ActorLaunch
from runtime.procutil import die_with_parent
from runtime.run_config import ActorSpec, RuntimeConfig
from runtime.zygote import Zygote, ZygoteChild, ZygoteUnavailable

__all__ = ["LocalBackend", "LocalProcess"]

log = structlog.get_logger(__name__)


class LocalProcess:
    """A subprocess of this one, or of its zygote (runtime.placement.PlacedProcess)."""

    node = "local"
    lost: str | None = None  # a subprocess cannot lose its node without this process going too

    def __init__(self, proc: asyncio.subprocess.Process | ZygoteChild, launch: ActorLaunch) -> None:
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
    """Starts actor processes here. ``preload``: the modules the zygote imports (the actors' entries);
    ``zygote_log``: where the zygote's own output goes; neither: every process starts plainly."""

    def __init__(self, preload: Sequence[str] = (), zygote_log: Path | None = None) -> None:
        self._preload = ("runtime.actor_process", *preload)
        self._zygote_log = zygote_log
        self._zygote: Zygote | None = None
        self._retired: list[Zygote] = []  # zygotes that fork nothing more, ending once their children have
        self._zygote_lock = asyncio.Lock()
        self._zygote_failed = zygote_log is None  # a zygote that could not start is not tried again

    @classmethod
    def for_run(cls, config: RuntimeConfig, run_dir: Path) -> LocalBackend:
        """The backend of a run: its zygote preloads the modules of the run's actor kinds."""
        entries = dict.fromkeys(spec.entry.partition(":")[0] for spec in config.actors.values())
        return cls(tuple(entries), run_dir / "logs" / "zygote.out")

    async def start(self, launch: ActorLaunch, spec: ActorSpec) -> LocalProcess:
        env = {**os.environ, **launch.env}
        launch.output_path.parent.mkdir(parents=True, exist_ok=True)
        with open(launch.output_path, "ab"):  # an unwritable log fails the start here, as a spawn's would
            pass
        if (zygote := await self._live_zygote()) is not None:
            try:
                return LocalProcess(await zygote.fork(launch.args, env, launch.output_path), launch)
            except ZygoteUnavailable as e:
                log.warning("zygote_unavailable", actor_id=launch.actor_id, error=str(e), stale=zygote.stale,
                            fix="nothing to do: this process starts plainly, the next from a new zygote")
        with open(launch.output_path, "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *launch.args,
                stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
                env=env)
        return LocalProcess(proc, launch)

    async def _live_zygote(self) -> Zygote | None:
        """The running zygote, a new one if the last has exited, or None (none could start)."""
        async with self._zygote_lock:
            if self._zygote is not None and not self._zygote.alive:
                self._retired = [z for z in self._retired if z.running]
                self._retired.append(self._zygote)  # its children, still running, die with it: not closed here
                self._zygote = None
            if self._zygote is None and not self._zygote_failed and self._zygote_log is not None:
                try:
                    self._zygote = await Zygote.start(self._preload, self._zygote_log)
                except (ZygoteUnavailable, OSError) as e:
                    self._zygote_failed = True
                    log.warning("zygote_not_started", error=str(e),
                                fix=f"see {self._zygote_log}; the run's processes start plainly meanwhile")
            return self._zygote

    def check(self, config: RuntimeConfig) -> None:
        """Every kind runs here: nothing to check."""

    async def close(self) -> None:
        """Ends the zygote (the processes, its children, have exited by then)."""
        async with self._zygote_lock:
            for zygote in [*self._retired, *([self._zygote] if self._zygote is not None else [])]:
                await zygote.close()
            self._zygote, self._retired = None, []
