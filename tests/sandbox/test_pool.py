"""EnvironmentPool lifecycle and warm acquisition."""

from __future__ import annotations

import pytest

from sandbox import Environment, EnvironmentPool, LayerStore, PoolConfig, SandboxStateError
from sandbox.pool import PoolStatus


async def test_pool_keeps_forks_warm_and_refills(store: LayerStore) -> None:
    with Environment.create(store, {"a.txt": "A"}) as env:
        snap = env.snapshot()
    pool = EnvironmentPool(PoolConfig(warm_per_snapshot=3))
    with pytest.raises(SandboxStateError, match="new; expected running"):
        await pool.acquire(snap)
    async with pool:
        pool.prewarm(snap)
        await pool.wait_warm()
        assert pool.num_warm(snap) == 3
        envs = [await pool.acquire(snap) for _ in range(5)]
        assert pool.num_hits >= 3
        for e in envs:
            assert (await e.run("cat a.txt")).stdout == "A"
            e.close()
        await pool.wait_warm()
        assert pool.num_warm(snap) == 3
        pool.forget(snap)
        assert pool.num_warm() == 0
        pool.prewarm(snap)
        await pool.wait_warm()
    assert pool.status is PoolStatus.STOPPED
    assert pool.num_warm() == 0
    await pool.stop()  # idempotent
    snap.release()
    assert store.num_layers() == 0


async def test_pool_evicts_oldest_snapshot(store: LayerStore) -> None:
    snaps = []
    for i in range(3):
        with Environment.create(store, {"i": str(i)}) as env:
            snaps.append(env.snapshot())
    async with EnvironmentPool(PoolConfig(warm_per_snapshot=1, max_snapshots=2)) as pool:
        for s in snaps:
            pool.prewarm(s)
        await pool.wait_warm()
        assert pool.num_warm(snaps[0]) == 0 and pool.num_warm() == 2
    for s in snaps:
        s.release()


def test_pool_config_validation() -> None:
    with pytest.raises(ValueError, match="warm_per_snapshot"):
        PoolConfig(warm_per_snapshot=0)
