"""Placement: where the supervisor's actor processes run, behind one interface whatever the backend.

The supervisor (runtime.supervisor) owns the policy (restarts, drain → stop → kill, hot swap, standby);
a backend owns only where and how a process starts and how it is signalled:

- ``local`` (runtime.local_backend): a subprocess of ``runtime.up``, in its own session, killed with it;
- ``ray`` (runtime.ray_backend): the same process started by a Ray actor on a node of a Ray cluster
  that has the kind's resources (``[actors.<kind>.placement]``), one OS process each.

What a process is started with (its command line and the environment it needs) is built here, once,
by `actor_launch`, for every backend: a change to how an actor finds its run is made in one place.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from runtime.actor_launch import RANK_ENV, WORLD_SIZE_ENV, RunAddress, actor_argv, actor_env
from runtime.bus_auth import RunCredentials
from runtime.run_config import ActorSpec, RuntimeConfig

__all__ = ["ActorLaunch", "PlacedProcess", "PlacementBackend", "PlacementError", "UnplacedProcess", "actor_launch"]


class PlacementError(RuntimeError):
    """A process could not be placed: no node has its resources, or the cluster cannot be reached."""


@dataclass(frozen=True)
class ActorLaunch:
    """How one actor process starts: ``<python> -m runtime.actor_process <args>`` with ``env`` added to
    its node's environment, its stdout and stderr appended to ``output_path`` (on its node)."""

    kind: str
    actor_id: str
    args: tuple[str, ...]  # after the interpreter
    env: dict[str, str] = field(default_factory=dict)
    output_path: Path = Path()
    standby: bool = False


def actor_launch(address: RunAddress, run_dir: Path, kind: str, actor_id: str, spec: ActorSpec, *, rank: int = 0,
                 standby: bool = False, credentials: RunCredentials | None = None) -> ActorLaunch:
    """The one place an actor process's command line and environment are built (every backend starts this):
    the run's address (``runtime.actor_launch``: bus, run id, credentials and TLS), its threads, its rank.
    ``credentials``: the supervisor's copy of the run's credentials (else read from their directory)."""
    env = actor_env(address, kind, {}, credentials)  # added to the node's own environment by the backend
    if spec.threads:
        env.update(OMP_NUM_THREADS=str(spec.threads), MKL_NUM_THREADS=str(spec.threads))
    if spec.ranks > 1:  # one of a process group: its rank and the group's size (the kind finds its peers)
        env.update({RANK_ENV: str(rank), WORLD_SIZE_ENV: str(spec.ranks)})
    args = tuple(actor_argv(address, run_dir, kind, actor_id, standby=standby)[1:])  # after the interpreter
    return ActorLaunch(kind, actor_id, args, env, run_dir / "logs" / f"{actor_id}.out", standby)


class PlacedProcess(Protocol):
    """One started actor process, wherever it runs (the part of ``asyncio.subprocess.Process`` the
    supervisor uses, plus where it is and why it may have vanished)."""

    @property
    def pid(self) -> int: ...  # on its node

    @property
    def node(self) -> str: ...  # the node it runs on ("local" for the local backend)

    @property
    def returncode(self) -> int | None: ...

    @property
    def lost(self) -> str | None:
        """Why the process vanished with its node (the node died or left), or None: an exit of its own."""
        ...

    async def wait(self) -> int:
        """Its exit status once it has exited (a lost one: -SIGKILL, with `lost` set)."""
        ...

    def send_signal(self, sig: signal.Signals) -> None:
        """Delivers ``sig`` to the process (ProcessLookupError: it has exited)."""
        ...

    async def kill(self) -> None:
        """SIGKILL to the process's whole session (its sandboxes too), then its exit."""
        ...

    def output_tail(self) -> str:
        """Where its output is, or the end of it, for an error event."""
        ...


class UnplacedProcess:
    """A start that failed (runtime.placement.PlacedProcess that has exited 1 at once): the supervisor
    counts it as a crash, so a kind no node can take fails the run by the restart intensity, saying why."""

    node = "none"
    pid = 0
    returncode = 1
    lost: str | None = None

    def __init__(self, error: PlacementError) -> None:
        self.error = error

    async def wait(self) -> int:
        return 1

    def send_signal(self, sig: signal.Signals) -> None:
        raise ProcessLookupError(f"never started: {self.error}")

    async def kill(self) -> None:
        """Nothing runs."""

    def output_tail(self) -> str:
        return f"not placed: {self.error}"


class PlacementBackend(Protocol):
    async def start(self, launch: ActorLaunch, spec: ActorSpec) -> PlacedProcess:
        """Starts the process ``launch`` describes where ``spec.placement`` allows (PlacementError if it cannot)."""
        ...

    def check(self, config: RuntimeConfig) -> None:
        """PlacementError unless every kind of ``config`` can be placed somewhere (before anything starts)."""
        ...

    async def close(self) -> None:
        """Releases what the backend holds (a Ray head it started); its processes have exited by then."""
        ...
