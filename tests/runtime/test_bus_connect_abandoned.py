"""A first connect the caller gives up on (its own deadline cancels it, or the connect's bound passes) leaves
nothing behind: no nats-py attempt or client task keeps running, so a command that then reads files instead
ends its event loop at once. The server is a real TCP listener that accepts and never says INFO (a server too
busy to answer), the client real nats-py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from runtime.bus import Bus, BusError


@pytest.fixture
async def silent_server() -> AsyncIterator[str]:
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"nats://127.0.0.1:{port}"
        for writer in held:
            writer.close()


async def _tasks_left() -> set[asyncio.Task]:
    for _ in range(20):  # a cancelled task needs a few loop turns to finish
        await asyncio.sleep(0)
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


async def test_a_connect_cancelled_by_the_callers_deadline_leaves_no_task(silent_server: str) -> None:
    before = await _tasks_left()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(Bus.connect(silent_server, name="ops-tail", connect_timeout_s=30.0), 0.3)
    assert await _tasks_left() - before == set()


async def test_a_connect_past_its_own_bound_leaves_no_task(silent_server: str) -> None:
    before = await _tasks_left()
    with pytest.raises(BusError, match="no answer within"):
        await Bus.connect(silent_server, name="ops-tail", connect_timeout_s=0.3)
    assert await _tasks_left() - before == set()
