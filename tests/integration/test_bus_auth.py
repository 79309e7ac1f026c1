"""Bus authentication: credentials files, what each role may do, and a remote bus with credentials.

Real nats-servers with the users `runtime.bus_auth` generates; real clients of each role.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import msgpack
import nats
import pytest
import structlog
from nats.js.api import RePublish

from actors.__main__ import DEFAULT_RUN_FILE
from actors.reconciler import ReconcilerActor
from actors.stages.evaluator import EvaluatorActor
from runtime.bus import Bus, Inbound
from runtime.bus_auth import (
    OPERATOR,
    SUPERVISOR,
    actor_permissions,
    control_subject,
    generate_credentials,
    read_credentials,
    tls_context,
)
from runtime.codec import Codec
from runtime.errors import BusError
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.registry import handover_key, registration_key
from runtime.run_config import import_entry, load_run_config
from runtime.run_state import new_run_id
from runtime.rundir import RunInfo
from runtime.up import bus_roles
from tests.integration.bus_clients import connect_anonymously, connect_as, default_run_bus
from tests.integration.harness import REPO, LiveRun, run_events, write_config
from tests.integration.sim_stages import SimConfig, StageSim, sim_run_toml
from tests.integration.workers import CountRequest
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)

COUNTER_RUN = """
[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = 1
heartbeat_s = 1.0
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_embedded_credentials_are_private_and_roles_are_confined(tmp_path: Path) -> None:
    roles = {"evaluator": actor_permissions("evaluator", EvaluatorActor.required_access()),
             "reconciler": actor_permissions("reconciler", ReconcilerActor.required_access())}
    users = generate_credentials(tmp_path / "credentials", roles)
    assert {u.credentials.user for u in users} == {SUPERVISOR, OPERATOR, "evaluator", "reconciler"}
    assert _mode(tmp_path / "credentials") == 0o700
    assert all(_mode(p) == 0o600 for p in (tmp_path / "credentials").iterdir())
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats", users=tuple(users))) as server:
        assert _mode(tmp_path / "nats" / "nats-server.conf") == 0o600
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await connect_anonymously(server.url)
        wrong = read_credentials(tmp_path / "credentials", "evaluator")
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await connect_anonymously(server.url, user=wrong.user, password=wrong.password + "x")
        admin = await Bus.connect(server.url, "admin", credentials=read_credentials(tmp_path / "credentials",
                                                                                       SUPERVISOR))
        try:
            await admin.ensure_base()
            await (await admin.kv("slots")).put("meta", b"m")
        finally:
            await admin.close()
        info = _info(server.url, tmp_path / "credentials")
        async with connect_as(info, "evaluator") as evaluator:
            # everything the evaluator does in a run goes through ...
            js = evaluator.nc.jetstream()
            slots = await js.key_value("slots")
            assert (await slots.get("meta")).value == b"m"
            await evaluator.nc.subscribe("weights.r1")
            await evaluator.nc.subscribe("data_exhausted.r1")
            await evaluator.publish("progress.eval", msgpack.packb({"x": 1}))
            await evaluator.nc.subscribe(control_subject("evaluator", "evaluator-1-abcd"))  # its own actors' control
            own_lease = registration_key("evaluator", "evaluator-1-abcd")
            assert await evaluator.js_publish(f"$KV.actors.{own_lease}", b"lease"), evaluator.errors
            with pytest.raises(nats.errors.NoRespondersError):
                await evaluator.nc.request("ctl.supervisor.finish", b"", timeout=1)
            await asyncio.sleep(0.3)
            assert not evaluator.errors, evaluator.errors
            # ... and nothing another role says
            await evaluator.publish("weights.r1", b"x")
            assert await evaluator.refused("weights.r1")
            await evaluator.publish("$KV.slots.meta", b"x")
            assert await evaluator.refused("$kv.slots.meta")
            await evaluator.nc.subscribe("_INBOX_reconciler.>")
            assert await evaluator.refused("_inbox_reconciler"), "nobody reads another role's replies"
            await evaluator.nc.subscribe("ctl.supervisor.stop")
            assert await evaluator.refused("ctl.supervisor.stop"), "no actor answers for the supervisor"
            await evaluator.nc.subscribe(control_subject("reconciler", "reconciler-1-abcd"))
            assert await evaluator.refused("ctl.reconciler."), "nor for another kind's actors"
            await evaluator.publish(f"$KV.actors.{registration_key('reconciler', 'reconciler-1-abcd')}", b"x")
            assert await evaluator.refused("$kv.actors.reg.reconciler."), "nor writes their leases"
            await evaluator.publish(f"$KV.actors.{handover_key('reconciler')}", b"x")
            assert await evaluator.refused("$kv.actors.handover.reconciler"), "nor their handover"
        async with connect_as(info, OPERATOR) as operator:
            assert not await operator.js_publish("$KV.slots.meta", b"x", timeout=1.0)
            assert await operator.refused("$kv.slots.meta")


def _info(url: str, credentials_dir: Path) -> RunInfo:
    """A RunInfo for a bus without a run: its address and credentials only."""
    return RunInfo("", url, "", "", 0, 0.0, str(credentials_dir))


async def test_a_remote_bus_takes_a_credentials_directory(tmp_path: Path) -> None:
    """``bus.url`` + ``bus.credentials_dir``: the run uses the remote server's users, one per role."""
    config = write_config(tmp_path / "run.toml", COUNTER_RUN)
    rt = load_run_config([config]).runtime
    users = generate_credentials(tmp_path / "remote-credentials", bus_roles(rt))  # what its operator set up
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "remote", users=tuple(users))) as server:
        run = await LiveRun(tmp_path / "run", config, "--set", f'bus.url="{server.url}"',
                            "--set", f'bus.credentials_dir="{tmp_path / "remote-credentials"}"').start()
        try:
            assert run.bus is not None and not (tmp_path / "run" / "credentials").exists()
            await run.wait_actors("counter", 1)
            await run.bus.publish_durable("work.count", await Codec([CountRequest]).encode(CountRequest("k1")))

            async def handled() -> bool:
                assert run.bus is not None
                try:
                    return (await (await run.bus.kv("effects")).get("k1")) is not None
                except Exception:
                    return False

            for _ in range(100):
                if await handled():
                    break
                await asyncio.sleep(0.1)
            assert await handled(), "the counter actor worked through the remote bus as its own role"
        finally:
            assert await run.stop() == 0


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bus-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "bus.pem", directory / "bus.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


async def test_a_remote_bus_over_tls(tmp_path: Path) -> None:
    """``bus.tls_ca_file``: the run's processes reach a TLS-only server and verify its certificate."""
    cert_file, key_file = _self_signed(tmp_path)

    class TlsServer(NatsServer):  # a cluster's server: TLS required (the embedded one stays on loopback)
        def _conf_text(self) -> str:
            return super()._conf_text() + f'tls {{\n  cert_file: "{cert_file}"\n  key_file: "{key_file}"\n}}\n'

    config = write_config(tmp_path / "run.toml", COUNTER_RUN)
    users = generate_credentials(tmp_path / "remote-credentials", bus_roles(load_run_config([config]).runtime))
    async with TlsServer(NatsServerConfig(store_dir=tmp_path / "remote", users=tuple(users))) as server:
        admin = read_credentials(tmp_path / "remote-credentials", SUPERVISOR)
        with pytest.raises(BusError):  # plain TCP is refused by a TLS-only server
            await Bus.connect(server.url, "plain", credentials=admin, connect_timeout_s=2.0)
        (tmp_path / "other").mkdir()
        other_ca, _ = _self_signed(tmp_path / "other")
        with pytest.raises(BusError):  # a server whose certificate the CA did not sign is not trusted
            await Bus.connect(server.url, "mitm", credentials=admin, tls=tls_context(str(other_ca)),
                              connect_timeout_s=2.0)
        run = await LiveRun(tmp_path / "run", config, "--set", f'bus.url="{server.url}"',
                            "--set", f'bus.credentials_dir="{tmp_path / "remote-credentials"}"',
                            "--set", f'bus.tls_ca_file="{cert_file}"').start()
        try:
            assert run.bus is not None
            await run.wait_actors("counter", 1)
            await run.bus.publish_durable("work.count", await Codec([CountRequest]).encode(CountRequest("k1")))
            for _ in range(100):
                with contextlib.suppress(Exception):
                    if await (await run.bus.kv("effects")).get("k1"):
                        break
                await asyncio.sleep(0.1)
            assert (await (await run.bus.kv("effects")).get("k1")).value, "the actor worked over TLS"
        finally:
            assert await run.stop() == 0


# --- a role's JetStream rights are its subject permissions' --------------------------------------------

DEFAULT_RUN = DEFAULT_RUN_FILE
_VIOLATION = re.compile(r'Permissions Violation for Publish to "([^"]+)"', re.IGNORECASE)


def _stream_api(stream: str, consumer: str, filter_subject: str) -> list[str]:
    """Every JetStream API subject that names a stream (and a consumer of it)."""
    api = "$JS.API"
    return [f"{api}.STREAM.{op}.{stream}" for op in (
        "CREATE", "UPDATE", "DELETE", "PURGE", "INFO", "MSG.GET", "MSG.DELETE", "SNAPSHOT", "RESTORE",
        "LEADER.STEPDOWN", "PEER.REMOVE")] + [
        f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.{filter_subject}",
        f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.{consumer}",
        f"{api}.CONSUMER.CREATE.{stream}.{consumer}.{filter_subject}",
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.{consumer}", f"{api}.CONSUMER.NAMES.{stream}",
        f"{api}.CONSUMER.LIST.{stream}"] + [f"{api}.CONSUMER.{op}.{stream}.{consumer}" for op in (
            "DELETE", "INFO", "MSG.NEXT", "PAUSE", "UNPIN", "LEADER.STEPDOWN")]


_ACCOUNT_API = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", "$JS.API.META.LEADER.STEPDOWN",
                "$JS.API.SERVER.REMOVE", "$JS.API.ACCOUNT.PURGE.x", "$JS.API.ACCOUNT.STREAM.MOVE.x.y",
                "$JS.API.STREAM.TEMPLATE.CREATE.x"]
# What a reader of a bucket needs: its keys (stream info), a key's record and a watch's snapshot (gets). No
# consumer: a watch reads the records the bucket's stream republishes (runtime.kv_watch), as a consumer
# would have a deliver subject the server does not check against the role's permissions
_BUCKET_READS = ("STREAM.INFO.{s}", "DIRECT.GET.{s}", "DIRECT.GET.{s}.{f}", "STREAM.MSG.GET.{s}")
# what the event log's reader (a kind declaring `stream_reader("LOG", ...)`) asks: its state, direct gets and the
# leader's newest message (a replicated LOG's replica may answer a direct get behind its leader)
_LOG_READS = ("STREAM.INFO.{s}", "DIRECT.GET.{s}", "STREAM.MSG.GET.{s}")
_OWN_QUEUE = ("CONSUMER.INFO.{s}.{c}", "CONSUMER.MSG.NEXT.{s}.{c}")  # bind, fetch (acks are $JS.ACK)


def _allowed(role: str, cls: type, subject: str, streams: dict[str, str]) -> bool:
    """What `role` may ask of JetStream: fetch from its own queues' consumers, read its buckets (and the
    event log, for a kind that declares it)."""
    access = cls.required_access()
    read_buckets = {"actors", "config", "run", *access.kv_read, *access.kv_write, *(b for b, _ in access.kv_keys)}
    for stream, consumer in streams.items():
        as_api = {f"$JS.API.{op.format(s=stream, c=consumer, f='x')}" for op in _BUCKET_READS}
        if stream.startswith("KV_") and stream[3:] in read_buckets and subject in as_api:
            return True
        log_api = {f"$JS.API.{op.format(s=stream, c=consumer, f='x')}" for op in _LOG_READS} | {"$JS.API.STREAM.NAMES"}
        if stream == "LOG" and any("STREAM.INFO.LOG" in p for p in access.publish) and subject in log_api:
            return True
        own = {f"$JS.API.{op.format(s=stream, c=consumer)}" for op in _OWN_QUEUE}
        if (stream, consumer) in access.streams and subject in own:
            return True
    return False


async def test_actor_roles_get_no_jetstream_rights_but_their_own_pull_consumers_and_reads(tmp_path: Path) -> None:
    """Every JetStream API subject, with every actor role of the default run: the server refuses all but
    binding to and fetching from its own queues' consumers (made by the supervisor) and reading its buckets.
    Otherwise a role could create and update its queues' streams and consumers (STREAM.UPDATE: capture other
    roles' subjects, republish into any) and create buckets."""
    rt = load_run_config([DEFAULT_RUN]).runtime
    async with default_run_bus(tmp_path) as (admin, info):
        streams = {s.name: "x" for s in await admin.stream_states()}
        classes = {kind: import_entry(spec.entry) for kind, spec in rt.actors.items()}
        for cls in classes.values():
            for q in cls.provisioned_queues():
                streams[q.stream] = q.durable  # its durable consumer: the one name a role may bind to
        assert {"Q_DONE", "Q_WORK_ROLLOUT", "KV_actors", "LOG", "DLQ"} <= set(streams)
        subjects = list(_ACCOUNT_API)
        for stream, consumer in streams.items():
            subjects += _stream_api(stream, consumer, "x")
        for role, cls in classes.items():
            async with connect_as(info, role) as client:
                for subject in subjects:
                    await client.nc.publish(subject, b"{}")
                await client.nc.flush()
                # (nats-py lowercases the server's error: subjects are compared lowercased)
                expected = {s.lower() for s in subjects if not _allowed(role, cls, s, streams)}

                def refused(client: Any = client) -> set[str]:
                    return {m.group(1) for e in client.errors if (m := _VIOLATION.search(e))}

                with contextlib.suppress(AssertionError):  # the comparison below says what is missing
                    await until(lambda expected=expected: expected <= refused(), 10.0, f"{role}: every refusal")
                assert refused() == expected, (role, sorted(refused() ^ expected))
                granted = {s.lower() for s in subjects} - refused()
                assert granted and not any(op in s for s in granted for op in (
                    "stream.create", "stream.update", "stream.delete", "stream.purge", "msg.delete", "durable",
                    "consumer.delete", "consumer.create")), (role, sorted(granted))


async def test_a_role_cannot_reconfigure_its_own_queue_stream(tmp_path: Path) -> None:
    """A STREAM.UPDATE of the rollout role's own work queue: capturing ``heartbeat.>`` and
    ``ctl.>``, and a republish into ``$KV.slots`` and ``ctl.supervisor.stop``. Refused; the stream unchanged.
    Unrefused, the server would apply each update."""
    async with default_run_bus(tmp_path) as (admin, info):
        before = await admin.js.stream_info("Q_WORK_ROLLOUT")
        async with connect_as(info, "rollout") as rollout:
            js = rollout.nc.jetstream(timeout=1.0)
            config = before.config
            for change in ({"subjects": [*config.subjects, "heartbeat.>", "ctl.>"]},
                           {"republish": RePublish(src=">", dest="$KV.slots.meta")},
                           {"republish": RePublish(src=">", dest="ctl.supervisor.stop")}):
                with pytest.raises((nats.errors.Error, TimeoutError)):
                    await js.update_stream(dataclasses.replace(config, **change))
            assert await rollout.refused("$js.api.stream.update.q_work_rollout")
        after = await admin.js.stream_info("Q_WORK_ROLLOUT")
        assert after.config.subjects == before.config.subjects and after.config.republish is None


async def test_no_actor_role_creates_a_consumer_on_a_bucket_or_the_event_log(tmp_path: Path) -> None:
    """Every actor role of the default run, on every bucket's stream and on LOG: CONSUMER.CREATE (bare, named,
    named with a filter) and DURABLE.CREATE are refused, among them a push consumer delivering the stream's
    messages into ``weights.<run>`` (the server does not check a deliver subject against its creator's
    permissions); none is made and nothing arrives there. A KV watch and a follow of the log need none
    (runtime.kv_watch). A role allowed one (a KV watch as an ordered push consumer, ops.tail's follow on LOG)
    could have ``weights.r1`` get the records."""
    rt = load_run_config([DEFAULT_RUN]).runtime
    async with default_run_bus(tmp_path) as (admin, info):
        await admin.kv_put("run", "build.x", b"the attacker's bytes")  # what would be delivered
        await admin.publish_durable("log.dashboard.info", b"the attacker's bytes")
        buckets = sorted(s.name for s in await admin.stream_states() if s.name.startswith("KV_"))
        assert {"KV_actors", "KV_config", "KV_run", "KV_slots"} <= set(buckets)
        buckets.append("LOG")
        delivered: list[bytes] = []

        async def note(msg: Any) -> None:
            delivered.append(msg.data)

        await admin.nc.subscribe("weights.r1", cb=note)
        for role in rt.actors:
            async with connect_as(info, role) as client:
                subjects = []
                for stream in buckets:
                    name = f"{role}_push"
                    written = "log.dashboard.info" if stream == "LOG" else f"$KV.{stream[3:]}.build.x"
                    request = json.dumps({"stream_name": stream, "config": {
                        "name": name, "deliver_subject": "weights.r1", "ack_policy": "none", "deliver_policy": "all",
                        "filter_subject": written}}).encode()
                    for subject in (f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
                                    f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{written}",
                                    f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}"):
                        subjects.append(subject)
                        await client.nc.publish(subject, request, reply=client.nc.new_inbox())
                await client.nc.flush()

                def refused(client: Any = client) -> set[str]:
                    return {m.group(1) for e in client.errors if (m := _VIOLATION.search(e))}

                expected = {s.lower() for s in subjects}
                with contextlib.suppress(AssertionError):  # the comparison below says what is missing
                    await until(lambda expected=expected: expected <= refused(), 10.0, f"{role}: every refusal")
                assert expected - refused() == set(), (role, sorted(expected - refused()))
        for stream in buckets:
            assert await admin.js.consumers_info(stream) == [], stream
        await admin.nc.flush()
        assert delivered == []


async def test_a_buckets_records_reach_its_readers_from_its_stream_only(tmp_path: Path) -> None:
    """What a KV watch reads: the bucket's stream republishes each record into ``kvwatch.<bucket>.<key>``,
    with its stream and sequence; a reader of the bucket subscribes there; no role publishes there (every
    actor role, the operator, and the supervisor too), so only the stream's records arrive."""
    rt = load_run_config([DEFAULT_RUN]).runtime
    async with default_run_bus(tmp_path) as (admin, info):
        received: list[tuple[str, bytes, str | None]] = []

        async def note(msg: Any) -> None:
            received.append((msg.subject, msg.data, (msg.headers or {}).get("Nats-Stream")))

        async with connect_as(info, "reconciler") as reader:
            for bucket in ("config", "actors", "slots"):  # docs/ARCHITECTURE.md, "Subjects": kvwatch.<bucket>.<key>
                await reader.nc.subscribe(f"kvwatch.{bucket}.>", cb=note)
            await reader.nc.flush()
            assert not reader.errors, reader.errors  # a reader of the bucket may subscribe there
            forged = ["kvwatch.config.sampling.temperature",
                      f"kvwatch.actors.{registration_key('reconciler', 'reconciler-1-abcd')}"]
            for role in (*rt.actors, OPERATOR):
                async with connect_as(info, role) as forger:
                    for subject in forged:
                        await forger.publish(subject, b"forged")
                        assert await forger.refused(subject), (role, subject)
            with structlog.testing.capture_logs() as events:
                await admin.publish(forged[0], b"forged by the supervisor")
                await admin.flush(5.0)
                await until(lambda: [e for e in events if e["event"] == "bus_permission_denied"], 10.0,
                            "the supervisor's refusal")
            await admin.kv_put("config", "sampling.temperature", b"0.7")
            await until(lambda: received, 10.0, "the stream's record")
            await reader.nc.flush()
        assert received == [("kvwatch.config.sampling.temperature", b"0.7", "KV_config")]


async def test_a_consumer_delivering_into_a_subscribed_subject_is_refused_by_the_receiver(tmp_path: Path) -> None:
    """A push consumer the rollout role tries to make on a bucket it reads (the ``run`` bucket, whose
    ``build.>`` keys it writes), delivering into ``weights.<run>``: the server refuses to make it
    (`test_no_actor_role_creates_a_consumer_on_a_bucket`), and the subscriber of ``weights.*`` would refuse
    what a stream delivered (a push consumer's delivery, a republished record) and say so: the reconciler's
    weights handler never gets the attacker's bytes."""
    async with default_run_bus(tmp_path) as (_, info):
        reconciler = await Bus.connect(info.nats_url, "reconciler", **info.bus_options("reconciler"))
        received: list[bytes] = []
        try:
            async def handler(msg: Inbound) -> None:
                received.append(msg.data)

            await reconciler.subscribe("weights.r1", handler)
            async with connect_as(info, "rollout") as rollout:
                await rollout.js_publish("$KV.run.build.x", b"attacker bytes")
                request = {"stream_name": "KV_run", "config": {"deliver_subject": "weights.r1", "ack_policy": "none",
                                                               "deliver_policy": "all"}}
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await rollout.nc.request("$JS.API.CONSUMER.CREATE.KV_run", json.dumps(request).encode(), 2.0)
                await rollout.publish("weights.r1", b"")  # the rollout may not announce weights itself either
                assert await rollout.refused("weights.r1")
                await rollout.js_publish("$KV.run.build.y", b"attacker bytes again")
            # the refusal is an event; wait for a message that came the legitimate way after them
            async with connect_as(info, "trainer") as trainer:
                await trainer.publish("weights.r1", b"the trainer's")
            await until(lambda: received, 10.0, "the trainer's announcement")
            assert received == [b"the trainer's"]
        finally:
            await reconciler.close()


async def test_a_reply_goes_only_to_the_requesters_inbox(tmp_path: Path) -> None:
    """A heartbeat whose reply-to names the supervisor's inbox, or a control subject: the answering side
    refuses to answer (``reply_refused``): the reconciler must answer neither into the supervisor's inbox nor
    into ``ctl.supervisor.stop``."""
    async with default_run_bus(tmp_path) as (admin, info):
        reconciler = await Bus.connect(info.nats_url, "reconciler", **info.bus_options("reconciler"))
        answered: list[bool] = []
        try:
            async def answer(msg: Inbound) -> None:
                answered.append(bool(await reconciler.respond(msg, b"answer", requester="rollout")))

            await reconciler.subscribe("heartbeat.>", answer)
            stolen: list[str] = []

            async def note(msg: Any) -> None:
                stolen.append(msg.subject)

            await admin.nc.subscribe("_INBOX_supervisor.>", cb=note)
            await admin.nc.subscribe("ctl.supervisor.stop", cb=note)
            async with connect_as(info, "rollout") as rollout:
                for reply in ("_INBOX_supervisor.abc.1", "ctl.supervisor.stop"):
                    await rollout.nc.publish("heartbeat.rollout", b"beat", reply=reply)
                reply = await rollout.nc.request("heartbeat.rollout", b"beat", timeout=5.0)  # its own inbox
                assert reply.data == b"answer"
            await admin.nc.flush()
            assert answered == [False, False, True] and not stolen, (answered, stolen)
        finally:
            await reconciler.close()


# --- the run's credentials ------------------------------------------------------------------------------


async def test_the_credentials_directory_deleted_mid_run_is_written_again_and_the_run_finishes(
        tmp_path: Path) -> None:
    """An operator deletes ``<run dir>/credentials`` mid-run and an actor is killed: the supervisor starts its
    replacement with the credentials it holds, writes the directory again (``credentials_restored``),
    ``ops.status`` works, and the run trains every prompt. Started from the deleted directory, the replacement
    could not sign in (``actor_crashed`` with an empty reason), the run would fail, and ops.status exit 2."""
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.1, sigma=0.3, max_s=0.5), train=StageSim(median_s=0.5, sigma=0.1),
              seed=3).write(run_dir)
    num_prompts, batch_groups = 16, 2
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=num_prompts, num_slots=8, group_size=2, batch_groups=batch_groups, eta=1, stage_timeout_s=20.0))
    run = await LiveRun(run_dir, cfg).start()
    try:
        victim, _ = await run.wait_actors("rollout", 2)
        (reconciler,) = await run.wait_actors("reconciler", 1)
        before = {p.name: p.read_text() for p in (run_dir / "credentials").iterdir()}
        shutil.rmtree(run_dir / "credentials")
        os.kill(victim["pid"], signal.SIGKILL)

        async def replaced() -> bool:  # the supervisor's list: the registry's keys come and go meanwhile
            ids = {a["id"] for a in await run.actors() if a["kind"] == "rollout"}
            return len(ids) == 2 and victim["id"] not in ids

        await until(replaced, 60.0, "the killed rollout actor replaced")
        await run.wait_actors("rollout", 2)  # and running: it signed in
        (restored,) = await until(lambda: run_events(run_dir, "credentials_restored"), 30.0, "credentials_restored")
        assert restored["directory"] == str(run_dir / "credentials") and "operator" in restored["roles"]
        assert {p.name: p.read_text() for p in (run_dir / "credentials").iterdir()} == before
        assert _mode(run_dir / "credentials") == 0o700 and _mode(run_dir / "credentials" / "operator.json") == 0o600
        status = await asyncio.create_subprocess_exec(sys.executable, "-m", "ops.status", str(run_dir), "--json",
                                                      cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                      stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(status.communicate(), 120.0)
        assert status.returncode == 0, stderr.decode()

        async def finished() -> bool:
            reply = await run.request(control_subject("reconciler", reconciler["id"], "status"))
            return bool(reply.get("finished"))

        await until(finished, 180.0, "the run to train every prompt")
        crashes = run_events(run_dir, "actor_crashed")
        assert all(e.get("reason") or e.get("error") for e in crashes), crashes  # never an empty reason
        assert [e["reason"] for e in crashes if e.get("actor_id") == victim["id"]] == ["killed by SIGKILL"]
    finally:
        assert await run.stop() == 0


async def test_resuming_by_id_without_the_credentials_says_which_are_missing(tmp_path: Path) -> None:
    """``--resume RUN --set bus.url=... --set storage.url=...`` against a bus that takes credentials, with
    none given: one configuration error naming the missing credentials and where they are expected, exit 2,
    at once, not nats-py's raw ``Authorization Violation`` warnings, again and again."""
    config = write_config(tmp_path / "run.toml", COUNTER_RUN)
    users = generate_credentials(tmp_path / "credentials", bus_roles(load_run_config([config]).runtime))
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats", users=tuple(users))) as server:
        up = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime.up", "--resume", new_run_id("gone"), "--set", f'bus.url="{server.url}"',
            "--set", f'storage.url="{(tmp_path / "blobs").as_uri()}"', "--quiet", cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output = (await asyncio.wait_for(up.communicate(), 60.0))[0].decode()
    assert up.returncode == 2, output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, output
    assert "credentials" in errors[0] and "bus.credentials_dir" in errors[0] and "<run dir>/credentials" in errors[0]
    assert output.lower().count("authorization violation") <= 1, output


async def test_a_registry_entry_written_to_last_is_judged_lost_by_the_reconciler_within_the_longest_lease(
        tmp_path: Path) -> None:
    """A complete rollout entry written by hand with ``Nats-TTL: never`` (which the server's max age spares, as
    it spares handover records) and a claimed lease of 10^9 s: the reconciler holds it to the run's longest
    lease (the bucket's max age), takes the actor for lost once unrenewed that long, and deletes the entry.
    Believed, it would count among the rollout actors for good, never lost."""
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.1, sigma=0.3, max_s=0.5), seed=7).write(run_dir)
    config = write_config(tmp_path / "run.toml", sim_run_toml(num_prompts=400, num_slots=8, group_size=2,
                                                              batch_groups=2, eta=1, stage_timeout_s=20.0))
    run = await LiveRun(run_dir, config).start()
    try:
        assert run.bus is not None and run.info is not None
        await run.wait_actors("reconciler", 1)
        bound_s = await run.bus.kv_max_age_s("actors")
        assert bound_s is not None and bound_s <= 15.0, bound_s
        key = registration_key("rollout", "rollout-9-beef")
        forged = {"kind": "rollout", "id": "rollout-9-beef", "pid": 4242, "host": "h", "code_hash": "c",
                  "state": "running", "num_inflight": 0, "num_handled": 0, "num_failed": 0,
                  "num_dead_lettered": 0, "uptime_s": 1.0, "lease_s": 1e9}
        async with connect_as(run.info, "rollout") as rollout:
            await rollout.nc.jetstream().publish(f"$KV.actors.{key}", msgpack.packb(forged),
                                                 headers={"Nats-TTL": "never"})
        written = asyncio.get_running_loop().time()

        async def deleted() -> bool:
            assert run.bus is not None
            return await run.bus.kv_get("actors", key) is None

        await until(deleted, 60.0, "the forged entry judged lost and deleted by the reconciler")
        assert asyncio.get_running_loop().time() - written < bound_s + 5.0, "within the longest lease (+ a tick)"
        lost = [e for e in run_events(run_dir, "actor_lost") if e.get("actor_id") == "rollout-9-beef"]
        assert lost and "lease" in lost[0]["reason"], lost
    finally:
        await run.stop()


async def test_a_registry_entry_written_by_hand_is_removed_by_the_server_within_the_lease(tmp_path: Path) -> None:
    """A complete registry entry of the role's own kind written by hand (no TTL, or a TTL far longer than
    any lease): the server removes it once the run's longest lease has passed, as it removes the entry of
    an actor that stopped renewing; a handover record written by the runtime outlives that bound. A forged
    entry must not stay on (and count as a live actor)."""
    config = write_config(tmp_path / "run.toml", COUNTER_RUN)  # one kind, the default lease: 10 s
    run = await LiveRun(tmp_path / "run", config).start()
    try:
        assert run.bus is not None and run.info is not None
        await run.wait_actors("counter", 1)
        forged = {"kind": "counter", "id": "counter-9-beef", "pid": 4242, "host": "h", "code_hash": "c",
                  "state": "running", "num_inflight": 0, "num_handled": 0, "num_failed": 0,
                  "num_dead_lettered": 0, "uptime_s": 1.0, "lease_s": 10.0}
        keys = {registration_key("counter", "counter-9-beef"): None,
                registration_key("counter", "counter-8-beef"): {"Nats-TTL": "3600"}}
        async with connect_as(run.info, "counter") as counter:
            js = counter.nc.jetstream()
            for key, headers in keys.items():
                await js.publish(f"$KV.actors.{key}", msgpack.packb(forged | {"id": key.split(".")[-1]}),
                                 headers=headers)
        await run.bus.kv_put("actors", handover_key("counter"), b"state for the next one")  # as the runtime does
        written = asyncio.get_running_loop().time()

        async def gone() -> bool:
            assert run.bus is not None
            return all([await run.bus.kv_get("actors", key) is None for key in keys])

        await until(gone, 30.0, "the forged entries removed by the server")
        assert asyncio.get_running_loop().time() - written < 10.0 + 5.0, "within the lease (+ the server's sweep)"
        assert (await run.bus.kv_get("actors", handover_key("counter"))) is not None, "a handover record lasts"
    finally:
        assert await run.stop() == 0
