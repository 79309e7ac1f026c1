"""WeightsFollower: signals -> fetch through weight_sync -> engine swap, once per version, failures skipped."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from actors.agent.weights_follower import WeightsFollower, WeightsUnavailable
from actors.messages import WeightsPublished
from actors.weights_announcements import weights_subject
from model.engine import GenerationEngine
from model.weight_sync import manifest_key
from model.weight_sync.publisher import PublisherConfig, WeightPublisher
from runtime.blob import BlobStore, open_store
from runtime.bus import Inbound
from runtime.codec import Codec
from runtime.errors import ConfigError
from runtime.metrics_log import numbered, read_metrics, write_metrics
from runtime.rundir import RunInfo
from tests.model.helpers import seeded_model, small_config

CONFIG = small_config(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
RUN = "follow1"


class FakeBus:
    """Records the subscription so a test can deliver ``weights.<run>`` signals by hand."""

    def __init__(self) -> None:
        self.callbacks: dict[str, Any] = {}

    async def subscribe(self, subject: str, handler: Any) -> Any:
        self.callbacks[subject] = handler

        async def unsubscribe() -> None:
            self.callbacks.pop(subject)

        return SimpleNamespace(unsubscribe=unsubscribe)

    async def signal(self, version: int) -> None:
        signal = WeightsPublished(RUN, version, manifest_key("weights", RUN, version), 0)
        data = await Codec([WeightsPublished]).encode(signal)
        await self.callbacks[weights_subject(RUN)](Inbound(weights_subject(RUN), data))


def versions_of_model(count: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(torch.bfloat16) for k, v in seeded_model(CONFIG, seed=s).state_dict().items()}
            for s in range(count)]  # fmt: skip


async def publish(store: BlobStore, states: list[dict[str, torch.Tensor]], versions: range) -> None:
    async with WeightPublisher(store, PublisherConfig(run=RUN, max_pending=len(states))) as publisher:
        await asyncio.gather(*(publisher.submit(v, states[v]) for v in versions))


def assert_engine_holds(engine: GenerationEngine, state: dict[str, torch.Tensor]) -> None:
    got = engine.model.state_dict()
    assert all(torch.equal(got[k].to(torch.bfloat16), v) for k, v in state.items())


async def test_follower_loads_announced_versions_once_and_skips_bad_ones(tmp_path: Path) -> None:
    states = versions_of_model(5)
    bus = FakeBus()
    async with open_store(f"file://{tmp_path}") as store, contextlib.AsyncExitStack() as stack:
        await publish(store, states, range(2))
        engine = GenerationEngine(seeded_model(CONFIG, seed=0))
        await engine.start()
        stack.push_async_callback(engine.stop)
        follower = WeightsFollower(bus, store, RUN, engine)
        await follower.start(stack)
        assert follower.latest == 1  # learned from the store at start
        with capture_logs() as logs:
            versions = await asyncio.gather(follower.load_latest(), follower.load_latest())  # racing callers
        assert versions == [1, 1] and engine.version == 1
        assert sum(e["event"] == "weights_swapped" and "engine" in e for e in logs) == 1  # applied once
        assert_engine_holds(engine, states[1])

        loaded: asyncio.Queue[int] = asyncio.Queue()

        async def next_loaded() -> int:
            return await asyncio.wait_for(loaded.get(), timeout=20)

        with capture_logs() as logs:
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(follower.follow(wanted=lambda v: v != 2, on_loaded=loaded.put))
                assert await next_loaded() == 1  # the version known at start is handed over once
                await publish(store, states, range(2, 4))
                await bus.signal(2)  # not wanted: skipped
                await store.put(f"weights/{RUN}/v{3:010d}/rank-00000-of-00001/shard-00000.bin", b"garbage")
                await bus.signal(3)
                assert await follower.load_latest() == 1  # corrupt: logged, the engine keeps version 1
                assert any(e["event"] == "weights_fetch_failed" and e["version"] == 3 for e in logs)
                await publish(store, states, range(4, 5))  # a fresh publisher: version 4 is an anchor
                await bus.signal(4)
                assert await next_loaded() == 4 and loaded.empty()
                task.cancel()
        assert engine.version == 4
        assert_engine_holds(engine, states[4])
        follower.announce(2)  # older than what the engine holds: nothing to do
        assert await follower.load_latest() == 4 and follower.latest == 4


async def test_reaching_a_version_waits_for_its_announcement_and_no_longer_than_its_bound(tmp_path: Path) -> None:
    """A rollout admitted under version v waits for v's announcement, event-driven, and gives up after its
    bound with an error naming the version (it polled every 0.5 s for ever: a trainer killed before the
    announcement left every rollout waiting)."""
    states = versions_of_model(3)
    bus = FakeBus()
    async with open_store(f"file://{tmp_path}") as store, contextlib.AsyncExitStack() as stack:
        await publish(store, states, range(1))
        engine = GenerationEngine(seeded_model(CONFIG, seed=0))
        await engine.start()
        stack.push_async_callback(engine.stop)
        follower = WeightsFollower(bus, store, RUN, engine)
        await follower.start(stack)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with capture_logs() as logs, pytest.raises(WeightsUnavailable, match=r"version 1 .* within 0\.5s"):
            await follower.reach(1, timeout_s=0.5)  # never announced
        assert 0.5 <= loop.time() - started < 3.0
        assert [e["version"] for e in logs if e["event"] == "weights_wait_timeout"] == [1]
        assert not any(e["event"] == "weights_fetch_failed" for e in logs), "nothing fetched before it exists"

        await publish(store, states, range(1, 2))  # in the store, never signalled: found there
        assert await follower.reach(1, timeout_s=5.0) == 1 and engine.version == 1

        async def announce_later() -> None:
            await asyncio.sleep(0.3)
            await publish(store, states, range(2, 3))
            await bus.signal(2)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(announce_later())
            assert await follower.reach(2, timeout_s=30.0) == 2
        assert_engine_holds(engine, states[2])


async def test_evaluator_and_plot_read_metrics_through_one_reader(tmp_path: Path) -> None:
    from ops.plot import read_metrics as plot_read

    storage = (tmp_path / "blobs").as_uri()
    RunInfo(str(tmp_path), "nats://127.0.0.1:1", storage, "", 0, 0.0, run_id="r1").write()
    async with open_store(storage) as store:
        assert await read_metrics(store) == []
        await write_metrics(store, "train", numbered(1), {"version": 1})
        await write_metrics(store, "eval", numbered(0), {"version": 0})
        assert await read_metrics(store, kind="eval") == [{"kind": "eval", "version": 0}]
    assert await asyncio.to_thread(plot_read, tmp_path) == [{"kind": "eval", "version": 0},
                                                             {"kind": "train", "version": 1}]
    with pytest.raises(ConfigError, match="run directory"):
        await asyncio.to_thread(plot_read, tmp_path / "nope")
