"""runtime.cancellation: a cancellation swallowed inside a `cancellation_kept` block reaches its task on leaving it,
whether the block returned or raised; one asked for before the block does not stop it; a deadline around it holds.
The swallowing wait stands for nats-py's (a library's wait that catches CancelledError)."""

from __future__ import annotations

import asyncio

import pytest

from runtime.cancellation import cancellation_kept, raise_if_cancelled


async def _swallowing_wait(started: asyncio.Event, then: BaseException | None = None) -> str:
    """Waits until cancelled, and swallows the cancellation: returns, or raises ``then``."""
    started.set()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        if then is not None:
            raise then from None
    return "as if nothing was asked"


async def _cancelled_while_swallowing(then: BaseException | None = None) -> tuple[asyncio.Task[str], list[str]]:
    started, after = asyncio.Event(), []

    async def call() -> str:
        with cancellation_kept():
            result = await _swallowing_wait(started, then)
        after.append(result)  # reached only when the cancellation was lost
        return result

    task = asyncio.create_task(call())
    await started.wait()
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    return task, after


async def test_a_cancellation_swallowed_in_the_block_is_raised_on_leaving_it() -> None:
    task, after = await _cancelled_while_swallowing()
    assert task.cancelled() and after == []


async def test_a_cancellation_swallowed_with_an_error_is_raised_instead_of_the_error() -> None:
    task, after = await _cancelled_while_swallowing(then=TimeoutError("the reply's own timeout, at that moment"))
    assert task.cancelled() and after == []


async def test_a_task_cancelled_before_the_block_runs_it_to_the_end() -> None:
    """A task cleaning up after its cancellation (its CancelledError caught, its clean-up calling the bus)."""
    ran: list[str] = []

    async def clean_up() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            with cancellation_kept():
                await asyncio.sleep(0)
                ran.append("clean-up")
            raise

    task = asyncio.create_task(clean_up())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled() and ran == ["clean-up"]


async def test_a_deadline_around_a_swallowing_block_holds() -> None:
    started = asyncio.Event()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            with cancellation_kept():
                await _swallowing_wait(started)


async def test_raise_if_cancelled_says_whether_the_task_was_ever_cancelled() -> None:
    raise_if_cancelled()  # not cancelled: nothing
    started = asyncio.Event()

    async def loop() -> None:
        while True:
            await _swallowing_wait(started)
            raise_if_cancelled()

    task = asyncio.create_task(loop())
    await started.wait()
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
