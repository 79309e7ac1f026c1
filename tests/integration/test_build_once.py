"""A run's one-time build on a real bus and store: one builder whoever asks, the others wait for it; a dead
builder is noticed within its lease, a failed one hands over, and nobody waits past the bound. A reader that
never builds (the dashboard: a policy's tokenizer) waits for whoever does, or shares, and takes only the files
it needs."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from runtime.blob import open_store
from runtime.build_once import BuildFailed, BuildSettings, build_once, claim_key, share_build
from runtime.bus import Bus
from runtime.run_state import RUN_BUCKET
from tests.integration.harness import nats_bus
from tests.waiting import until


class Builder:
    """Counts its builds; each writes one file and takes ``seconds``."""

    def __init__(self, seconds: float = 0.0, fail_first: bool = False) -> None:
        self.seconds = seconds
        self.fail_first = fail_first
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, out: Path) -> None:
        with self.lock:
            self.calls += 1
            failing = self.fail_first and self.calls == 1
        time.sleep(self.seconds)
        if failing:
            raise OSError("disk full")
        (out / "weights.bin").write_bytes(b"w" * 100)


async def test_many_machines_asking_at_once_build_once_and_all_get_it(tmp_path: Path) -> None:
    builder = Builder(seconds=3.0)
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        settings = BuildSettings(lease_s=1.5, timeout_s=60.0)  # the build outlasts the lease: renewals keep it
        paths = await asyncio.gather(*(
            build_once(bus, store, "policy-abc", builder, tmp_path / f"machine-{i}", owner=f"a-{i}", settings=settings)
            for i in range(4)))
        assert builder.calls == 1, "one builder, the others waited"
        assert [p.joinpath("weights.bin").read_bytes() for p in paths] == [b"w" * 100] * 4
        assert await bus.kv_get(RUN_BUCKET, claim_key("policy-abc")) is None, "the claim is released"
        # later, on yet another machine: fetched, not built
        again = await build_once(bus, store, "policy-abc", builder, tmp_path / "machine-9", owner="late")
        assert builder.calls == 1 and again.joinpath("weights.bin").exists()


async def test_a_dead_builder_is_noticed_within_its_lease(tmp_path: Path) -> None:
    builder = Builder()
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        await bus.kv_create(RUN_BUCKET, claim_key("policy-abc"), b'{"owner": "killed -9"}')  # never renewed
        started = time.monotonic()
        with capture_logs() as logs:
            path = await build_once(bus, store, "policy-abc", builder, tmp_path / "m", owner="b",
                                    settings=BuildSettings(lease_s=1.5, timeout_s=30.0))
        took = time.monotonic() - started
        assert builder.calls == 1 and path.joinpath("weights.bin").exists()
        assert 1.5 <= took < 10.0, took
        assert [e["lapsed_holder"] for e in logs if e["event"] == "lease_taken_over"] == ['{"owner": "killed -9"}']


async def test_a_failed_build_is_reported_and_another_process_builds(tmp_path: Path) -> None:
    builder = Builder(seconds=0.5, fail_first=True)
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        settings = BuildSettings(lease_s=5.0, timeout_s=60.0)
        first = asyncio.create_task(build_once(bus, store, "p", builder, tmp_path / "a", owner="a", settings=settings))
        await until(lambda: bus.kv_get(RUN_BUCKET, claim_key("p")), 10, "a's claim")  # a claims first
        second = build_once(bus, store, "p", builder, tmp_path / "b", owner="b", settings=settings)
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert isinstance(results[0], BuildFailed) and "disk full" in str(results[0])
        assert isinstance(results[1], Path) and results[1].joinpath("weights.bin").exists()
        assert builder.calls == 2
        assert not list((tmp_path / "a").glob(".building-*")), "the failed build's folder is removed"


async def test_a_build_that_never_ends_is_not_waited_for_past_the_bound(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        revision = await bus.kv_create(RUN_BUCKET, claim_key("p"), b'{"owner": "slow"}')

        async def renew_forever(bus: Bus, revision: int) -> None:
            while True:
                await asyncio.sleep(0.3)
                revision = await bus.kv_cas(RUN_BUCKET, claim_key("p"), b'{"owner": "slow"}', revision)

        async with asyncio.TaskGroup() as tg:
            renewing = tg.create_task(renew_forever(bus, revision))
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await build_once(bus, store, "p", Builder(), tmp_path / "m", owner="w",
                                 settings=BuildSettings(lease_s=1.0, timeout_s=3.0))
            assert 3.0 <= time.monotonic() - started < 6.0
            renewing.cancel()


def _policy(out: Path) -> None:
    (out / "weights.bin").write_bytes(b"w" * 1000)
    (out / "tokenizer.json").write_text("{}")


async def test_a_reader_waits_for_the_build_without_building_and_takes_only_its_members(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        waited: list[bool] = []
        reader = asyncio.create_task(build_once(  # before anyone claimed the build
            bus, store, "p", None, tmp_path / "reader", owner="r", members=["tokenizer.json", "absent.json"],
            on_wait=lambda: waited.append(True)))
        await until(lambda: waited, 10, "the reader waiting")
        built = await build_once(bus, store, "p", _policy, tmp_path / "builder", owner="b",
                                 settings=BuildSettings(lease_s=1.5, timeout_s=30.0))
        path = await asyncio.wait_for(reader, 10)  # woken by the release of the lease
        assert sorted(p.name for p in path.iterdir()) == ["tokenizer.json"], "its members, those the build has"
        assert path.parent == tmp_path / "reader" and path.name.startswith("p.part-"), "never taken for the build"
        assert (built / "weights.bin").exists() and waited == [True]
        again = await build_once(None, store, "p", None, tmp_path / "offline", owner="o", members=["tokenizer.json"])
        assert again.joinpath("tokenizer.json").read_text() == "{}", "a finished run's reader: the stored build"


async def test_a_reader_wakes_when_a_machine_shares_a_build_it_had(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        found = tmp_path / "machine-a" / "p"
        found.mkdir(parents=True)
        _policy(found)
        waited: list[bool] = []
        reader = asyncio.create_task(build_once(bus, store, "p", None, tmp_path / "reader", owner="r",
                                                on_wait=lambda: waited.append(True)))
        await until(lambda: waited, 10, "the reader waiting")
        assert await share_build(bus, store, "p", found, owner="a")
        path = await asyncio.wait_for(reader, 10)
        assert path.joinpath("weights.bin").read_bytes() == b"w" * 1000
        assert await bus.kv_get(RUN_BUCKET, claim_key("p")) is None, "shared under the lease, released"
        assert not await share_build(bus, store, "p", found, owner="a"), "stored already"


async def test_a_reader_is_bounded_and_a_finished_runs_reader_is_told_the_build_is_not_stored(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus, open_store((tmp_path / "blobs").as_uri()) as store:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await build_once(bus, store, "p", None, tmp_path / "m", owner="r",
                             settings=BuildSettings(lease_s=1.0, timeout_s=1.5))
        assert 1.5 <= time.monotonic() - started < 5.0
        with pytest.raises(FileNotFoundError, match="not stored"):
            await build_once(None, store, "p", None, tmp_path / "m", owner="r")
