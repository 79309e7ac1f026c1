"""A run's stop drains every actor process, also one whose start was under way when the stop began.

Found by tests/integration/test_reconciler.py on a loaded machine: an actor crashed, the supervisor began its
restart, and the run was asked to stop while the new process was being placed. The drain took its list of
processes without it; placed a moment later, it was supervised, never drained, and the run waited on it until
the test killed runtime.up (exit -9). The supervisor's `_spawn` and `_shutdown` over a placement backend whose
start is held until the test releases it, and a bus double answering a drain as an actor would; the real
processes are in tests/integration.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
from structlog.testing import capture_logs

from runtime.actor_launch import RunAddress
from runtime.run_config import ActorSpec, HealthSection, RuntimeConfig
from runtime.supervisor import Supervisor
from tests.runtime.placed_process import PlacedProcessDouble


class _HeldBackend:
    """Places a process only once `release` is set: a start that outlasts the stop's beginning."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.placing = asyncio.Event()
        self.placed: list[PlacedProcessDouble] = []

    async def start(self, launch: Any, spec: Any) -> PlacedProcessDouble:
        self.placing.set()
        await self.release.wait()
        proc = PlacedProcessDouble(4000 + len(self.placed))
        self.placed.append(proc)
        return proc


class _Bus:
    """Answers a drain request as an actor does: it drains and its process exits."""

    def __init__(self, backend: _HeldBackend) -> None:
        self.health = SimpleNamespace(down=asyncio.Event())
        self.backend = backend
        self.drained: list[str] = []

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        actor_id, verb = subject.rsplit(".", 2)[-2:]
        assert verb == "drain", subject
        self.drained.append(actor_id)
        for proc in self.backend.placed:
            asyncio.get_running_loop().call_soon(proc.exit)
        return msgpack.packb({"ok": True, "state": "draining"})


async def test_a_process_placed_after_the_drain_began_is_drained_too(tmp_path: Path) -> None:
    cfg = RuntimeConfig(health=HealthSection(interval_s=0.0),
                        actors={"worker": ActorSpec("runtime.actor:Actor", drain_timeout_s=5.0)})
    backend = _HeldBackend()
    bus = _Bus(backend)
    supervisor = Supervisor(cfg, tmp_path, bus, RunAddress("nats://127.0.0.1:1", "r1"),  # type: ignore[arg-type]
                            backend=backend)  # type: ignore[arg-type]
    with capture_logs() as logs:
        async with asyncio.timeout(10):
            async with asyncio.TaskGroup() as tg:  # the run's own group: every watch and retirement in it
                supervisor._tg = tg
                restart = tg.create_task(supervisor._spawn("worker"))  # a restart, its placement under way
                await backend.placing.wait()
                supervisor.request_stop()
                await supervisor._shutdown()  # drains what it finds: nothing placed yet
                backend.release.set()
                (new,) = [await restart]
            # the group ended: the late process was drained and exited, nothing waits on it
    assert backend.placed[0].returncode == 0 and bus.drained == [new.actor_id]
    assert [e["actor_id"] for e in logs if e["event"] == "actor_retired_on_start"] == [new.actor_id]
    assert [e["actor_id"] for e in logs if e["event"] == "actor_exited"] == [new.actor_id]


async def test_a_process_placed_before_the_drain_began_is_drained_once(tmp_path: Path) -> None:
    cfg = RuntimeConfig(health=HealthSection(interval_s=0.0),
                        actors={"worker": ActorSpec("runtime.actor:Actor", drain_timeout_s=5.0)})
    backend = _HeldBackend()
    backend.release.set()
    bus = _Bus(backend)
    supervisor = Supervisor(cfg, tmp_path, bus, RunAddress("nats://127.0.0.1:1", "r1"),  # type: ignore[arg-type]
                            backend=backend)  # type: ignore[arg-type]
    with capture_logs() as logs:
        async with asyncio.timeout(10):
            async with asyncio.TaskGroup() as tg:
                supervisor._tg = tg
                ap = await supervisor._spawn("worker")
                supervisor.request_stop()
                await supervisor._shutdown()
    assert bus.drained == [ap.actor_id], "drained by the stop, and only once"
    assert not [e for e in logs if e["event"] == "actor_retired_on_start"]
