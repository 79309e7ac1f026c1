"""EnvironmentPool: keeps forks of registered snapshots warm so rollouts never wait on creation.

Lifecycle: ``start()`` -> ``acquire()`` / ``prewarm()`` / ``forget()`` -> ``stop()`` (all
idempotent where it makes sense; wrong-state calls raise `SandboxStateError` naming both
states). A single owned refill task, woken by an event (no polling), tops each registered
snapshot back up to ``warm_per_snapshot`` ready environments after every acquire.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from dataclasses import dataclass, field

import structlog

from sandbox.config import SandboxLimits
from sandbox.env import Environment
from sandbox.errors import SandboxStateError
from sandbox.layers import Snapshot

__all__ = ["EnvironmentPool", "PoolConfig", "PoolStatus"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    """Attributes:
    warm_per_snapshot: ready environments kept per registered snapshot.
    max_snapshots: registered snapshots at most; registering more evicts the oldest.
    limits: limits of the environments the pool creates.
    """

    warm_per_snapshot: int = 4
    max_snapshots: int = 16
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def __post_init__(self) -> None:
        if self.warm_per_snapshot < 1:
            raise ValueError(f"PoolConfig.warm_per_snapshot must be >= 1, got {self.warm_per_snapshot}")
        if self.max_snapshots < 1:
            raise ValueError(f"PoolConfig.max_snapshots must be >= 1, got {self.max_snapshots}")


class PoolStatus(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class EnvironmentPool:
    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self.status = PoolStatus.NEW
        self._snapshots: dict[str, Snapshot] = {}
        self._warm: dict[str, deque[Environment]] = {}
        self._wake = asyncio.Event()
        self._refilled = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.num_hits = 0
        self.num_misses = 0

    def _require(self, expected: PoolStatus) -> None:
        if self.status is not expected:
            raise SandboxStateError(f"EnvironmentPool is {self.status.value}; expected {expected.value}")

    async def start(self) -> None:
        """Start the refill task (idempotent while running)."""
        if self.status is PoolStatus.RUNNING:
            return
        self._require(PoolStatus.NEW)
        self.status = PoolStatus.RUNNING
        self._task = asyncio.create_task(self._refill_loop(), name="sandbox-pool-refill")

    async def stop(self) -> None:
        """Stop refilling and close every warm environment (idempotent)."""
        if self.status is PoolStatus.STOPPED:
            return
        self.status = PoolStatus.STOPPED
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for key in list(self._warm):
            self._drop(key)

    async def __aenter__(self) -> EnvironmentPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def prewarm(self, snapshot: Snapshot) -> None:
        """Keep ``warm_per_snapshot`` forks of ``snapshot`` ready from now on."""
        self._require(PoolStatus.RUNNING)
        if snapshot.id in self._snapshots:
            return
        while len(self._snapshots) >= self.config.max_snapshots:
            self._drop(next(iter(self._snapshots)))
        self._snapshots[snapshot.id] = snapshot
        self._warm[snapshot.id] = deque()
        self._wake.set()

    def forget(self, snapshot: Snapshot) -> None:
        """Stop keeping ``snapshot`` warm and close its ready environments."""
        self._drop(snapshot.id)

    def num_warm(self, snapshot: Snapshot | None = None) -> int:
        if snapshot is not None:
            return len(self._warm.get(snapshot.id, ()))
        return sum(len(q) for q in self._warm.values())

    async def acquire(self, snapshot: Snapshot) -> Environment:
        """A ready environment forked from ``snapshot`` (warm if one is waiting); caller closes it."""
        self._require(PoolStatus.RUNNING)
        queue = self._warm.get(snapshot.id)
        if queue:
            self.num_hits += 1
            self._wake.set()
            return queue.popleft()
        self.num_misses += 1
        return Environment.fork(snapshot, self.config.limits)

    async def wait_warm(self) -> None:
        """Wait until every registered snapshot has its warm environments."""
        self._require(PoolStatus.RUNNING)
        async with self._refilled:
            await self._refilled.wait_for(self._all_warm)

    def _all_warm(self) -> bool:
        return all(len(self._warm[k]) >= self.config.warm_per_snapshot for k in self._snapshots)

    def _drop(self, key: str) -> None:
        self._snapshots.pop(key, None)
        for env in self._warm.pop(key, deque()):
            env.close()

    async def _refill_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for key, snapshot in list(self._snapshots.items()):
                queue = self._warm.get(key)
                while queue is not None and len(queue) < self.config.warm_per_snapshot:
                    if snapshot.released or snapshot.store.closed:
                        self._drop(key)
                        break
                    try:
                        queue.append(Environment.fork(snapshot, self.config.limits))
                    except Exception:
                        log.exception("sandbox_pool_refill_failed", snapshot=snapshot.id)
                        self._drop(key)
                        break
                    await asyncio.sleep(0)  # let acquirers run between forks
                    queue = self._warm.get(key)
            async with self._refilled:
                self._refilled.notify_all()
