"""A task cancelled at the moment a nats-py call of the bus completes is cancelled: the call does not return, an
iterator does not yield nor go on waiting. Python 3.11's ``asyncio.wait_for`` inside nats-py swallows such a
cancellation (`runtime.cancellation`); here the moment is made exact: the real nats-py call, against a real
nats-server, is awaited through a ``wait_for`` whose inner call's completion cancels the caller in the same loop
turn, as the race does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.bus import Bus, Inbound
from tests.integration.harness import nats_bus

_ENDS_WITHIN_S = 5.0  # a cancelled task that has not ended by then went on after its cancellation


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[Bus]:
    async with nats_bus(tmp_path) as connected:
        yield connected


def swallow_once(owner: Any, name: str) -> list[str]:
    """Patches ``owner.name`` (a nats-py coroutine method) so that its next call, made for real, cancels its
    caller in the loop turn where it completes, through ``asyncio.wait_for`` (which then swallows the
    cancellation, as nats-py's own waits do); later calls are untouched. Returns a list that says when it did."""
    real: Callable[..., Awaitable[Any]] = getattr(owner, name)
    done: list[str] = []

    async def call(*args: Any, **kwargs: Any) -> Any:
        if done:
            return await real(*args, **kwargs)
        done.append(name)
        caller = asyncio.current_task()
        assert caller is not None
        inner = asyncio.ensure_future(real(*args, **kwargs))
        inner.add_done_callback(lambda _: caller.cancel())  # runs before wait_for's own callback: same turn
        return await asyncio.wait_for(inner, 30.0)

    setattr(owner, name, call)
    return done


def _num_subscriptions(bus: Bus) -> int:
    """The subscriptions the bus's client holds (one left behind would go on receiving, and delay its close)."""
    return len(bus.nc._subs)


async def _ended_cancelled(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` ended cancelled within the bound (if not, it is cancelled again, to end the test)."""
    done, _ = await asyncio.wait({task}, timeout=_ENDS_WITHIN_S)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=_ENDS_WITHIN_S)
    return task in done and task.cancelled()


async def test_a_request_cancelled_as_its_reply_comes_is_cancelled(bus: Bus) -> None:
    await bus.subscribe("svc.echo", lambda msg: _answer(bus, msg))
    assert await bus.request("svc.echo", b"x", timeout_s=5) == b"x"  # the responder answers
    swallowed = swallow_once(bus.nc, "request")
    asking = asyncio.create_task(bus.request("svc.echo", b"y", timeout_s=5))
    assert await _ended_cancelled(asking), "the request returned its reply to a cancelled task"
    assert swallowed


async def _answer(bus: Bus, msg: Inbound) -> None:
    await bus.respond(msg, msg.data)


async def test_a_jetstream_publish_cancelled_as_it_is_acknowledged_is_cancelled(bus: Bus) -> None:
    swallowed = swallow_once(bus.js, "publish")
    publishing = asyncio.create_task(bus.publish_durable("log.test.info", b"line", msg_id="m-1"))
    assert await _ended_cancelled(publishing), "the publish returned to a cancelled task"
    assert swallowed


async def test_a_kv_watch_cancelled_as_it_opens_is_cancelled_and_yields_nothing(bus: Bus) -> None:
    await bus.kv_put("config", "rollout.temperature", b"\x01")
    await bus.kv("config")  # the bucket known: the next stream-info request is the watch's own read
    num_subscriptions = _num_subscriptions(bus)
    swallowed = swallow_once(bus.js, "stream_info")
    seen: list[Any] = []

    async def watch() -> None:
        async for entry in bus.kv_watch("config"):
            seen.append(entry)  # on a cancelled watch: went on to wait for a change that may never come

    watching = asyncio.create_task(watch())
    assert await _ended_cancelled(watching), f"the watch went on after its cancellation (yielded {seen})"
    assert swallowed and seen == []
    assert _num_subscriptions(bus) == num_subscriptions, "the watch's subscription was left behind"


async def test_a_follow_cancelled_as_it_opens_is_cancelled_and_yields_nothing(bus: Bus) -> None:
    await bus.publish_durable("log.test.info", b"kept")
    num_subscriptions = _num_subscriptions(bus)
    swallowed = swallow_once(bus.js, "stream_info")  # the follow's read of the stream's state, as it opens
    seen: list[Any] = []

    async def follow() -> None:
        async for msg in bus.follow("log.>", "new"):  # nothing new comes: a follow that goes on waits for ever
            seen.append(msg)

    following = asyncio.create_task(follow())
    assert await _ended_cancelled(following), f"the follow went on after its cancellation (yielded {seen})"
    assert swallowed and seen == []
    assert _num_subscriptions(bus) == num_subscriptions, "the follow's subscription was left behind"


async def test_a_subscribe_cancelled_as_it_is_made_is_cancelled_and_undone(bus: Bus) -> None:
    num_subscriptions = _num_subscriptions(bus)
    swallowed = swallow_once(bus.nc, "subscribe")
    subscribing = asyncio.create_task(bus.subscribe("svc.echo", lambda msg: _answer(bus, msg)))
    assert await _ended_cancelled(subscribing), "the subscription was handed to a cancelled task"
    assert swallowed and _num_subscriptions(bus) == num_subscriptions, "a subscription nobody holds was left"


async def test_a_flush_cancelled_as_the_server_answers_is_cancelled(bus: Bus) -> None:
    swallowed = swallow_once(bus.nc, "flush")
    flushing = asyncio.create_task(bus.flush(timeout_s=5))
    assert await _ended_cancelled(flushing), "the flush returned to a cancelled task"
    assert swallowed


async def test_a_task_cleaning_up_after_its_cancellation_still_uses_the_bus(bus: Bus) -> None:
    """Only a cancellation asked for during a call is raised again: a task already cancelled, saying so on its
    way out, is not stopped by its own clean-up's calls."""
    started = asyncio.Event()

    async def work() -> None:
        try:
            started.set()
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await bus.kv_put("config", "cleaned", b"up")
            assert await bus.request("svc.echo", b"z", timeout_s=5) == b"z"
            raise

    await bus.subscribe("svc.echo", lambda msg: _answer(bus, msg))
    working = asyncio.create_task(work())
    await started.wait()
    working.cancel()
    assert await _ended_cancelled(working)
    entry = await bus.kv_get("config", "cleaned")
    assert entry is not None and entry.value == b"up"
