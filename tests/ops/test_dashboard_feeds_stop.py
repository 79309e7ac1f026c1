"""The dashboard's status sampling ends when it is cancelled (its actor drains), even when nats-py swallowed the
cancellation in a request: Python 3.11's ``asyncio.wait_for`` inside nats-py does when its inner future finishes at
the same moment (`runtime.actor.raise_if_cancelled`). The sampling asks every ``dashboard.sample_s`` (0.5 s in the
browser test), so a drain nearly always meets a request in flight; the loop went on, and the dashboard actor never
stopped (killed after its drain timeout; its run's supervisor_stopped never said)."""

from __future__ import annotations

import asyncio

from ops.dashboard.feeds import sample_status
from ops.dashboard.model import RunView
from runtime.errors import BusTimeout


class _SwallowingBus:
    """No actor registered; the supervisor's status request swallows a cancellation, as nats-py's can."""

    def __init__(self) -> None:
        self.asking = asyncio.Event()
        self.num_swallowed = 0

    async def kv_keys(self, bucket: str) -> list[str]:
        return []

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        self.asking.set()
        try:
            await asyncio.sleep(timeout_s)
        except asyncio.CancelledError:
            if self.num_swallowed:  # once is the fault; a second cancellation (the test's clean-up) ends it
                raise
            self.num_swallowed += 1  # swallowed: the caller's task is still cancelling, and nothing here says so
        raise BusTimeout(f"no reply on {subject}")


async def test_a_cancelled_sampling_ends_though_a_request_swallowed_its_cancellation() -> None:
    bus = _SwallowingBus()
    sampling = asyncio.create_task(sample_status(bus, RunView("r"), sample_s=0.05))  # type: ignore[arg-type]
    await asyncio.wait_for(bus.asking.wait(), 5)
    sampling.cancel()
    done, _ = await asyncio.wait({sampling}, timeout=5)
    if not done:
        sampling.cancel()
        await asyncio.wait({sampling}, timeout=5)
    assert bus.num_swallowed == 1 and sampling in done and sampling.cancelled(), "it went on after its cancellation"
