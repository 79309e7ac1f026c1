"""runtime.gather.gather_or_cancel: results in order; the first failure stops the rest and is raised as itself."""

from __future__ import annotations

import asyncio

import pytest

from runtime.gather import gather_or_cancel


async def blocks(name: str, started: asyncio.Event, cancelled: list[str]) -> None:
    """Runs until cancelled, noting it."""
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(name)
        raise


async def test_results_come_in_the_order_of_the_awaitables() -> None:
    async def after(delay_s: float, value: int) -> int:
        await asyncio.sleep(delay_s)
        return value

    assert await gather_or_cancel(after(0.03, 1), after(0.0, 2), after(0.01, 3)) == [1, 2, 3]
    assert await gather_or_cancel() == []


async def test_the_first_failure_cancels_the_others_before_it_is_raised_as_itself() -> None:
    started, cancelled = asyncio.Event(), []

    async def fails() -> None:
        await started.wait()
        raise PermissionError("refused")

    with pytest.raises(PermissionError, match="refused"):  # not an ExceptionGroup: callers catch their own errors
        await asyncio.wait_for(gather_or_cancel(blocks("a", started, cancelled), fails(),
                                                blocks("b", started, cancelled)), 5)
    assert sorted(cancelled) == ["a", "b"], "both were cancelled and had ended when the error came"


async def test_cancelling_the_caller_cancels_every_awaitable() -> None:
    running, cancelled = asyncio.Event(), []
    caller = asyncio.create_task(gather_or_cancel(blocks("a", running, cancelled), blocks("b", running, cancelled)))
    await asyncio.wait_for(running.wait(), 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert sorted(cancelled) == ["a", "b"]


async def test_a_caught_failure_leaves_the_caller_uncancelled_and_its_timeout_a_timeout() -> None:
    """On Python 3.11 a TaskGroup whose child fails leaves the caller marked cancelling: a timeout
    around the call, expiring after it, then raised CancelledError instead of TimeoutError."""

    async def fails_soon() -> None:
        await asyncio.sleep(0.01)
        raise OSError("refused")

    started, cancelled = asyncio.Event(), []
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            with pytest.raises(OSError):
                await gather_or_cancel(fails_soon(), blocks("slow", started, cancelled))
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
            await asyncio.Event().wait()  # until the timeout
    assert cancelled == ["slow"]


async def test_a_caller_cancelled_while_the_others_unwind_gets_its_cancellation() -> None:
    unwinding, release = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            unwinding.set()
            await release.wait()  # a transfer that takes a moment to end
            raise

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise OSError("refused")

    caller = asyncio.create_task(gather_or_cancel(slow_to_stop(), fails()))
    await asyncio.wait_for(unwinding.wait(), 5)
    caller.cancel()  # the caller's own cancellation, after the failure: not lost in the child's error
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
