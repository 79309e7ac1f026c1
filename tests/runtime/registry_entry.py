"""A bus double's answer to the health checks' watch of an actor's registry entry: one running entry, then none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgpack


def running_entry(kind: str, actor_id: str, pid: int) -> AsyncIterator[Any]:
    """What ``Bus.kv_watch`` yields for a registered, running actor whose entry then never changes."""
    async def entries() -> AsyncIterator[Any]:
        info = {"kind": kind, "id": actor_id, "state": "running", "pid": pid, "host": "h", "code_hash": "c",
                "num_inflight": 0, "num_handled": 0, "num_failed": 0, "num_dead_lettered": 0, "uptime_s": 1.0}
        yield SimpleNamespace(deleted=False, value=msgpack.packb(info))
        await asyncio.Event().wait()
    return entries()
