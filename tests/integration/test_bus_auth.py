"""Bus authentication: credentials files, what each role may do, and a remote bus with credentials.

Real nats-servers with the users `runtime.bus_auth` generates; real clients of each role.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from pathlib import Path

import msgpack
import nats
import pytest

from actors.reconciler import ReconcilerActor
from actors.stages.evaluator import EvaluatorActor
from runtime.bus import Bus
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
from runtime.run_config import load_run_config
from runtime.rundir import RunInfo
from runtime.up import bus_roles
from tests.integration.bus_clients import connect_anonymously, connect_as
from tests.integration.harness import LiveRun, write_config
from tests.integration.workers import CountRequest

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
