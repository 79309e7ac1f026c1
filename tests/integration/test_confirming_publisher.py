"""`ConfirmingPublisher` on real nats-servers: messages sent without a round trip each are all stored, exactly
once, through what loses them otherwise: a stream not there yet (refused at once), acknowledgements that come
too late (the copy sent again is deduplicated), and the kill -9 of the stream's leader on a three-server
cluster (the messages sent during the election are published again once a new leader takes them)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from runtime.bus import Bus, BusLimits, ConfirmingPublisher, work_queue
from runtime.natsserver import NatsCluster, NatsServer, NatsServerConfig

pytestmark = pytest.mark.timeout(180)

QUEUE = work_queue("rollout")


async def _stored_ids(bus: Bus, stream: str) -> list[str]:
    """The message ids of every message the stream holds, in order (duplicates would show twice)."""
    info = await bus.js.stream_info(stream)
    ids = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await bus.js.get_msg(stream, seq)
        ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))
    return ids


async def _all_confirmed(publisher: ConfirmingPublisher, timeout_s: float) -> float:
    """Seconds until nothing is unconfirmed (the publisher's `run` going meanwhile)."""
    started = time.monotonic()
    await publisher.wait_confirmed(timeout_s)
    return time.monotonic() - started


async def _running(publisher: ConfirmingPublisher) -> asyncio.Task[None]:
    task = asyncio.create_task(publisher.run())
    await asyncio.sleep(0)
    return task


async def test_a_message_refused_because_its_stream_is_missing_is_stored_once_the_stream_exists(
        tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test")
        publisher = await bus.confirming_publisher(confirm_within_s=1.0)
        confirming = await _running(publisher)
        try:
            with structlog.testing.capture_logs() as events:
                for i in range(5):
                    await publisher.publish("work.rollout", f"order-{i}".encode(), msg_id=f"order-{i}")
                await asyncio.sleep(1.0)  # refused ("no responders") and sent again, more than once
                assert publisher.num_unconfirmed == 5
                await bus.ensure_queue(QUEUE)
                await _all_confirmed(publisher, timeout_s=10)
            assert await _stored_ids(bus, QUEUE.stream) == [f"order-{i}" for i in range(5)]
            assert publisher.num_published == 5 and publisher.num_republished >= 5
            refused = [e for e in events if e["event"] == "publish_not_confirmed"]
            assert refused and all(e["subjects"] == ["work.rollout"] for e in refused)
            assert refused[0]["reason"].startswith("no stream answered"), refused[0]
        finally:
            confirming.cancel()
            await bus.close()


class _AcknowledgementsLost(ConfirmingPublisher):
    """The first 50 acknowledgements never arrive (the replies lost on the way, as when the server that
    stored the messages dies before answering): the messages are stored all the same."""

    num_lost = 0

    async def _on_acknowledgement(self, msg: Any) -> None:
        if self.num_lost < 50:
            self.num_lost += 1
            return
        await super()._on_acknowledgement(msg)


async def test_a_message_stored_whose_acknowledgement_is_lost_is_sent_again_and_dropped_as_a_copy(
        tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test")
        await bus.ensure_queue(QUEUE)
        publisher = await _AcknowledgementsLost(bus.nc, confirm_within_s=0.2).open()
        confirming = await _running(publisher)
        try:
            ids = [f"order-{i}" for i in range(50)]
            for msg_id in ids:
                await publisher.publish("work.rollout", msg_id.encode(), msg_id=msg_id)
            await _all_confirmed(publisher, timeout_s=30)
            assert publisher.num_republished >= 50  # more if a loaded machine delays an acknowledgement past 0.2 s
            assert await _stored_ids(bus, QUEUE.stream) == ids, "each stored once, in order"
        finally:
            confirming.cancel()
            await bus.close()


async def test_messages_sent_while_the_stream_elects_a_leader_are_stored_once_it_has_one(tmp_path: Path) -> None:
    cluster = NatsCluster(NatsServerConfig(store_dir=tmp_path / "nats", restart_delay_s=30.0), size=3)
    await cluster.start()
    supervised = asyncio.create_task(cluster.supervise())
    bus = await Bus.connect(cluster.urls, name="test", limits=BusLimits(replicas=3))
    publisher = await bus.confirming_publisher()
    confirming = await _running(publisher)
    try:
        await bus.ensure_queue(QUEUE)
        await publisher.publish("work.rollout", b"before", msg_id="before")
        await _all_confirmed(publisher, timeout_s=10)

        info = await bus.js.stream_info(QUEUE.stream)
        assert info.cluster is not None and info.cluster.leader
        (leader,) = [s for s in cluster.servers if s.config.server_name == info.cluster.leader]
        assert leader.pid is not None
        os.kill(leader.pid, signal.SIGKILL)  # its stream needs a new leader: what is sent meanwhile is lost
        killed_at = time.monotonic()
        ids = [f"during-{i}" for i in range(20)]
        for msg_id in ids:
            await publisher.publish("work.rollout", msg_id.encode(), msg_id=msg_id)
            await asyncio.sleep(0.1)
        stored_after_s = time.monotonic() - killed_at + await _all_confirmed(publisher, timeout_s=60)
        stored = await _stored_ids(bus, QUEUE.stream)
        print(f"{len(ids)} messages sent over the first 2 s of an election; all stored {stored_after_s:.2f}s after "
              f"the kill, {publisher.num_republished} sent again")
        assert sorted(stored) == sorted(["before", *ids]), stored
        assert len(stored) == len(set(stored)), "none stored twice"
        assert publisher.num_republished > 0, "the election lost none of them: the kill did not hit the stream"
        assert stored_after_s < 20.0, "stored within the election and a backoff, not after a stage's timeout"
    finally:
        confirming.cancel()
        supervised.cancel()
        await bus.close()
        await cluster.stop()


async def test_a_message_no_stream_ever_takes_is_abandoned_loudly_after_the_bound(tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test")
        publisher = await ConfirmingPublisher(bus.nc, confirm_within_s=0.2, give_up_after_s=1.5).open()
        confirming = await _running(publisher)
        try:
            with structlog.testing.capture_logs() as events:
                for i in range(3):
                    await publisher.publish("work.nowhere", b"x", msg_id=f"lost-{i}")
                await _all_confirmed(publisher, timeout_s=10)  # nothing left to follow: given up on
            assert publisher.num_abandoned == 3 and publisher.num_unconfirmed == 0
            (abandoned,) = [e for e in events if e["event"] == "publish_abandoned"]
            assert abandoned["log_level"] == "error" and abandoned["msg_ids"] == ["lost-0", "lost-1", "lost-2"]
        finally:
            confirming.cancel()
            await publisher.close()
            await bus.close()
