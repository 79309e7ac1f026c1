"""The bus on a real three-server JetStream cluster on loopback (runtime.natsserver.NatsCluster), leases
the bus expires by itself, and the sign-in forms of a remote bus (NKEY users, a list of server URLs)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import nkeys
import pytest
import structlog.testing

from runtime.bus import Bus, BusLimits, work_queue
from runtime.bus_auth import BusCredentials, BusUser, Permissions, read_credentials
from runtime.errors import BusError
from runtime.natsserver import NatsCluster, NatsServer, NatsServerConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)


async def _stream_replicas(bus: Bus, stream: str) -> tuple[int, str, list[str]]:
    """(configured replicas, leader, peers) of a stream on the cluster."""
    info = await bus.js.stream_info(stream)
    cluster = info.cluster
    assert cluster is not None, f"{stream} has no cluster info: not on a cluster"
    return info.config.num_replicas or 1, cluster.leader or "", [p.name for p in cluster.replicas or []]


async def _write_until_accepted(bus: Bus, key: str, timeout_s: float) -> float:
    """Seconds until a KV write is acknowledged (the writes that fail meanwhile are retried at once)."""
    started = time.monotonic()
    while True:
        try:
            async with asyncio.timeout(2.0):
                await bus.kv_put("slots", key, b"after")
            return time.monotonic() - started
        except (BusError, TimeoutError):  # no leader yet, or the connection moving to another server
            if time.monotonic() - started > timeout_s:
                raise
            await asyncio.sleep(0.05)


async def test_a_cluster_replicates_every_stream_and_carries_on_when_a_server_is_killed(tmp_path: Path) -> None:
    # restarted 20 s after a kill (an election under load took over 6 s in CI): the writes must go through without it
    cluster = NatsCluster(NatsServerConfig(store_dir=tmp_path / "nats", restart_delay_s=20.0), size=3)
    await cluster.start()
    supervised = asyncio.create_task(cluster.supervise())
    bus = await Bus.connect(cluster.urls, name="test", limits=BusLimits(replicas=3))
    try:
        await bus.ensure_base()
        await bus.ensure_queue(work_queue("rollout"))
        for stream in ("LOG", "DLQ", "KV_slots", "KV_config", "KV_actors", "Q_WORK_ROLLOUT"):
            replicas, leader, peers = await _stream_replicas(bus, stream)
            assert replicas == 3 and leader and len(peers) == 2, (stream, replicas, leader, peers)
        for i in range(50):
            await bus.kv_put("slots", f"slot.{i}", f"v{i}".encode())
        await bus.publish_durable("work.rollout", b"order-1", msg_id="order-1")

        # kill -9 the leader of the slot table's stream: its writes need a new leader elected
        _, leader, _ = await _stream_replicas(bus, "KV_slots")
        (victim,) = [s for s in cluster.servers if s.config.server_name == leader]
        assert victim.pid is not None
        with structlog.testing.capture_logs() as events:
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            stall_s = await _write_until_accepted(bus, "slot.0", timeout_s=30.0)
            _, new_leader, _ = await _stream_replicas(bus, "KV_slots")
            restarted = [e for e in events if e["event"] == "nats_server_restarted"]
            assert not restarted, "the write went through while the killed server was still down"
            while not restarted and time.monotonic() - killed_at < 45:
                await asyncio.sleep(0.1)
                restarted = [e for e in events if e["event"] == "nats_server_restarted"]
        print(f"KV writes stalled {stall_s:.2f}s after kill -9 of the stream leader {leader}; new leader {new_leader}")
        assert new_leader and new_leader != leader
        assert stall_s < 15.0, stall_s
        assert restarted, "the killed server was restarted on its ports and store"
        for i in range(1, 50):  # nothing written before the kill was lost
            entry = await bus.kv_get("slots", f"slot.{i}")
            assert entry is not None and entry.value == f"v{i}".encode()
        consumer = await bus.pull_consumer(work_queue("rollout"))
        (order,) = await consumer.fetch(1, timeout_s=10.0)
        assert order.data == b"order-1"
        await order.ack()

        async def rejoined() -> bool:  # the restarted server is a current replica again
            info = await bus.js.stream_info("KV_slots")
            return all(p.current for p in info.cluster.replicas or []) and len(info.cluster.replicas or []) == 2

        await until(rejoined, 30, "the restarted server to catch up", every_s=0.2)
    finally:
        await bus.close()
        supervised.cancel()
        await cluster.stop()


async def test_a_client_moves_to_another_server_and_says_so(tmp_path: Path) -> None:
    """The connection's own server killed: it reconnects to another member of the list (evented)."""
    async with NatsCluster(NatsServerConfig(store_dir=tmp_path / "nats"), size=3) as cluster:
        bus = await Bus.connect(cluster.url, name="test", limits=BusLimits(replicas=3))
        try:
            await bus.ensure_base()
            own = bus.nc.connected_url.netloc
            (victim,) = [s for s in cluster.servers if s.url.endswith(own)]
            with structlog.testing.capture_logs() as events:
                os.kill(victim.pid or 0, signal.SIGKILL)
                async with asyncio.timeout(20):
                    await bus.health.down.wait()
                    await bus.health.up.wait()
            reconnected = [e for e in events if e["event"] == "bus_reconnected"]
            assert reconnected and reconnected[-1]["server"] != own, reconnected
            assert [e for e in events if e["event"] == "bus_disconnected"]
            await _write_until_accepted(bus, "slot.x", timeout_s=20.0)
        finally:
            await bus.close()


async def test_a_lease_key_is_removed_by_the_bus_once_it_is_not_renewed(tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test")
        try:
            await bus.ensure_base()
            watch = bus.kv_watch("actors")
            assert await anext(watch) is None  # the (empty) current values
            seen = []

            async def first_removal() -> float:  # when the watch saw it, while the renewals go on
                async for entry in watch:
                    seen.append((entry.key, "PURGE" if entry.purged else "DEL" if entry.deleted else None))
                    if entry.deleted:
                        return time.monotonic()
                raise AssertionError("the watch ended")

            written = time.monotonic()
            await bus.kv_put("actors", "reg.rollout.rollout-1", b"entry", ttl_s=2.0)
            await bus.kv_put("actors", "reg.rollout.rollout-2", b"entry", ttl_s=2.0)
            removal = asyncio.create_task(asyncio.wait_for(first_removal(), 8))
            for _ in range(10):  # rollout-2 renews its lease (1.5 s to spare for a loaded machine), rollout-1 does not
                await asyncio.sleep(0.5)
                await bus.kv_put("actors", "reg.rollout.rollout-2", b"entry", ttl_s=2.0)
            took_s = await removal - written
            assert seen[-1] == ("reg.rollout.rollout-1", "PURGE"), seen
            assert 1.9 <= took_s < 5.0, took_s  # the TTL, and the server's expiry sweep
            assert await bus.kv_get("actors", "reg.rollout.rollout-1") is None
            assert await bus.kv_get("actors", "reg.rollout.rollout-2") is not None
            assert await bus.kv_keys("actors") == ["reg.rollout.rollout-2"]
        finally:
            await bus.close()


async def test_a_registry_bucket_made_without_ttls_takes_them_or_says_it_cannot(tmp_path: Path) -> None:
    """A bucket of an older run: writes with a TTL go through without one (said), until ensure_base updates it."""
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test")
        try:
            await bus.js.add_stream(name="KV_actors", subjects=["$KV.actors.>"], max_msgs_per_subject=1,
                                    allow_direct=True, allow_rollup_hdrs=True, deny_delete=True)
            with structlog.testing.capture_logs() as events:
                await bus.kv_put("actors", "reg.a.a-1", b"entry", ttl_s=1.0)
            assert [e for e in events if e["event"] == "kv_ttl_unsupported"]
            assert (await bus.kv_get("actors", "reg.a.a-1")) is not None  # written, without a TTL

            updated = await Bus.connect(server.url, name="updated")
            try:
                await updated.ensure_base()
                await updated.kv_put("actors", "reg.a.a-2", b"entry", ttl_s=1.0)
                await asyncio.sleep(2.5)
                assert await updated.kv_get("actors", "reg.a.a-2") is None, "the bus expired it"
                assert await updated.kv_get("actors", "reg.a.a-1") is not None, "no TTL: only a reader expires it"
            finally:
                await updated.close()
        finally:
            await bus.close()


async def test_an_nkey_user_signs_in_from_its_seed_file_and_a_wrong_seed_is_refused(tmp_path: Path) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    user = BusUser(BusCredentials("rollout"), Permissions(publish=(">",), subscribe=(">",)), nkey=public)
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "rollout.nk").write_bytes(seed)
    (tmp_path / "other.nk").write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats", users=(user,))) as server:
        creds = read_credentials(credentials, "rollout")
        assert creds.nkey_seed_file == str(credentials / "rollout.nk")
        bus = await Bus.connect(server.url, name="nkey", credentials=creds)
        try:
            assert await bus.request("$JS.API.INFO", b"", timeout_s=5.0)
        finally:
            await bus.close()
        with pytest.raises(BusError, match="cannot connect"):
            await Bus.connect(server.url, name="wrong", credentials=BusCredentials(
                "rollout", nkey_seed_file=str(tmp_path / "other.nk")), connect_timeout_s=2.0)


def test_credentials_files_are_read_by_their_form_and_a_malformed_one_is_named(tmp_path: Path) -> None:
    from runtime.errors import ConfigError

    (tmp_path / "a.json").write_text(json.dumps({"user": "a", "password": "p"}))
    (tmp_path / "b.nk").write_text("not a seed")
    (tmp_path / "c.creds").write_text("-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n"
                                      "-----BEGIN USER NKEY SEED-----\nSUx\n------END USER NKEY SEED------\n")
    assert read_credentials(tmp_path, "a").connect_options() == {"inbox_prefix": "_INBOX_a", "user": "a",
                                                                 "password": "p"}
    with pytest.raises(ConfigError, match=r"b\.nk are malformed.*NKEY user seed"):
        read_credentials(tmp_path, "b")
    assert read_credentials(tmp_path, "c").connect_options() == {"inbox_prefix": "_INBOX_c",
                                                                 "user_credentials": str(tmp_path / "c.creds")}
    with pytest.raises(ConfigError, match=r"no bus credentials for role 'd'.*d\.json.*d\.nk.*d\.creds"):
        read_credentials(tmp_path, "d")


async def test_a_url_list_with_a_dead_server_connects_to_a_live_one(tmp_path: Path) -> None:
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        dead = NatsServer(NatsServerConfig(store_dir=tmp_path / "dead"))
        await dead.start()
        dead_url = dead.url
        await dead.stop()
        for _ in range(3):  # the pool's order is random: the dead one first or not
            bus = await Bus.connect(f"{dead_url},{server.url}", name="test", connect_timeout_s=5.0)
            try:
                assert bus.nc.connected_url.netloc == server.url.removeprefix("nats://")
            finally:
                await bus.close()


@pytest.mark.parametrize("size", [1, 3])
async def test_chained_writes_of_one_key_in_flight_together_are_stored_and_a_stale_one_is_refused(
        tmp_path: Path, size: int) -> None:
    """A replicated stream refuses a write whose key has another write in flight; the chain covers it."""
    from runtime.bus import ChainedKVWriter, ChainedWriteConflict

    server = NatsCluster(NatsServerConfig(store_dir=tmp_path / "nats"), size) if size > 1 else \
        NatsServer(NatsServerConfig(store_dir=tmp_path / "nats"))
    async with server:
        bus = await Bus.connect(server.url, name="test", limits=BusLimits(replicas=size))
        try:
            await bus.ensure_base()
            writer = await ChainedKVWriter.open(bus, "slots")
            revision = writer.write("slot.1", b"a", None)
            for value in (b"b", b"c", b"d"):  # one slot's transitions, sent together
                revision = writer.write("slot.1", value, revision)
            writer.write("slot.2", b"x", None)
            await writer.flush()
            entry = await bus.kv_get("slots", "slot.1")
            assert entry is not None and (entry.value, entry.revision) == (b"d", revision)

            # A replicated stream refuses the stale write at once and stores the one before it a raft
            # round later: the failed flush returns only when that prefix is stored. Repeated, as the
            # refusal outrunning the acknowledgement is a race.
            for round_ in range(20):
                stale = await ChainedKVWriter.open(bus, "slots")
                first = stale.write("slot.1", b"e%d" % round_, revision)
                stale.write("slot.1", b"f", first - 1)  # not what the key holds when it is applied
                with pytest.raises(ChainedWriteConflict):
                    await stale.flush()
                await stale.close()
                entry = await bus.kv_get("slots", "slot.1")
                assert entry is not None and (entry.value, entry.revision) == (b"e%d" % round_, first), \
                    f"round {round_}: the chain's prefix is stored, nothing after"
                revision = first
        finally:
            await bus.close()


async def test_a_chain_whose_own_writes_were_dropped_is_a_failed_write_and_a_foreign_write_a_conflict(
        tmp_path: Path) -> None:
    """A leader lost with writes in flight drops them without a word: the next write finds the bucket
    behind the chain, with writes before it never acknowledged (on a replicated bucket each one asks).
    That is this writer's failure (resume from the store), not another writer's (stop)."""
    from runtime.bus import ChainedKVWriter, ChainedWriteConflict, KVWriteFailed

    async with NatsCluster(NatsServerConfig(store_dir=tmp_path / "nats"), size=3) as cluster:
        bus = await Bus.connect(cluster.url, name="test", limits=BusLimits(replicas=3))
        try:
            await bus.ensure_base()
            dropped = await ChainedKVWriter.open(bus, "slots")
            dropped._sent += 2  # two writes sent that the stream never stored (as an election drops them)
            dropped._last += 2
            dropped.write("slot.9", b"x", None)
            with pytest.raises(KVWriteFailed, match="were not stored") as failed:
                await dropped.flush()
            assert not isinstance(failed.value, ChainedWriteConflict)

            fenced = await ChainedKVWriter.open(bus, "slots")
            await bus.kv_put("slots", "slot.1", b"another reconciler")
            fenced.write("slot.8", b"x", None)
            with pytest.raises(ChainedWriteConflict):
                await fenced.flush()
        finally:
            await bus.close()
