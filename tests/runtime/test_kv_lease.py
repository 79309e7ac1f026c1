"""The lease's renewals on a real nats-server: a renewal that landed although its answer was lost keeps the
lease; a key another holder wrote loses it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from runtime.kv_lease import KVLease
from runtime.run_state import RUN_BUCKET
from tests.integration.harness import nats_bus

LEASE_S = 0.6  # renewed every 0.2 s


async def test_a_renewal_that_landed_unanswered_keeps_the_lease(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        lease = KVLease(bus, RUN_BUCKET, "holder", b"me", LEASE_S)
        assert await lease.try_acquire()
        # what the bus did while the holder's call timed out: the holder's own renewal, at a revision it never saw
        assert lease.revision is not None
        landed = await bus.kv_cas(RUN_BUCKET, "holder", b"me", lease.revision)
        keeper = asyncio.create_task(lease.keep())
        try:
            await asyncio.sleep(4 * LEASE_S)
            assert not keeper.done(), "the lease was given up although nobody else holds it"
            assert lease.held and lease.revision is not None and lease.revision > landed
            assert (await lease.holder()).value == b"me"
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)


async def test_a_key_another_holder_wrote_loses_the_lease(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        lease = KVLease(bus, RUN_BUCKET, "holder", b"me", LEASE_S)
        assert await lease.try_acquire()
        assert lease.revision is not None
        await bus.kv_cas(RUN_BUCKET, "holder", b"someone else", lease.revision)  # took over a lapsed lease
        await asyncio.wait_for(lease.keep(), timeout=4 * LEASE_S)  # returns: lost
        assert not lease.held
        assert (await lease.holder()).value == b"someone else"
