"""An actor the supervisor drains on purpose (swap, stop, finish) fails no health check on its way out (issue 30,
item 8): it stops answering pings once it has unsubscribed, before its process exits, and each ping then was a
``health_check_failed`` warning though nothing needed a person. Its retirement has its own bounds (the drain
timeout, then TERM, then KILL), so its checks end when it begins.

The supervisor's `_retire` and its health checks (`runtime.health`), over a bus double answering as an actor
would; the real processes are in tests/integration (test_health.py, test_hot_swap.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
from structlog.testing import capture_logs

from runtime.actor_launch import RunAddress
from runtime.errors import NoResponders
from runtime.run_config import ActorSpec, HealthSection, RuntimeConfig
from runtime.supervisor import ActorProcess, Supervisor
from tests.runtime.placed_process import PlacedProcessDouble
from tests.runtime.registry_entry import running_entry

SILENT_S = 0.6  # from its drain request to its exit: its exit stack closing (engines, sandboxes)


class _Actor:
    """The bus as one running actor answers it: pings answered until it is asked to drain, then nothing listens
    (it unsubscribed), and its process exits ``SILENT_S`` later."""

    def __init__(self, proc: PlacedProcessDouble) -> None:
        self.health = SimpleNamespace(down=asyncio.Event())
        self.proc = proc
        self.num_pings = 0
        self.checked = asyncio.Event()  # answered a few pings: its checks are under way
        self.draining = False

    def kv_watch(self, bucket: str, key: str) -> AsyncIterator[Any]:
        return running_entry("worker", "worker-1-ab", 4242)

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        verb = subject.rsplit(".", 1)[-1]
        if self.draining:
            raise NoResponders(f"no responders on {subject}")
        if verb == "drain":
            self.draining = True
            asyncio.get_running_loop().call_later(SILENT_S, self.proc.exit)
            return msgpack.packb({"ok": True, "state": "draining"})
        self.num_pings += 1
        if self.num_pings == 3:
            self.checked.set()
        return msgpack.packb({"ok": True, "state": "running", "busy_without_progress_s": 0.0})


async def test_an_actor_drained_on_purpose_fails_no_health_check_on_its_way_out(tmp_path: Path) -> None:
    cfg = RuntimeConfig(health=HealthSection(interval_s=0.05, ping_timeout_s=0.5, probe_every=0, max_failures=3,
                                             start_grace_s=5.0),
                        actors={"worker": ActorSpec("runtime.actor:Actor", drain_timeout_s=10.0)})
    proc = PlacedProcessDouble()
    bus = _Actor(proc)
    supervisor = Supervisor(cfg, tmp_path, bus, RunAddress("nats://127.0.0.1:1", "r1"))  # type: ignore[arg-type]
    ap = ActorProcess("worker", "worker-1-ab", proc)  # type: ignore[arg-type]
    supervisor.procs[ap.actor_id] = ap
    with capture_logs() as logs:
        async with asyncio.timeout(10):
            ap.health = asyncio.create_task(supervisor._check_health(ap))
            await bus.checked.wait()
            await supervisor._retire(ap)
            assert proc.returncode == 0, "drained, not signalled"
            await ap.health  # its checks ended with the retirement: the task does not linger
    assert [e for e in logs if e["event"].startswith("health_check") or e["log_level"] in ("warning", "error")] == []
