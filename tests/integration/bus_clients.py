"""Raw NATS clients of a live run for the bus-trust tests: as a role (its credentials), or as nobody.

An attacker's client is not a `runtime.bus.Bus`: it records the server's refusals (permission
violations arrive asynchronously through the error callback) so that a test can assert them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from actors.__main__ import DEFAULT_RUN_FILE
from runtime.bus import Bus
from runtime.bus_auth import SUPERVISOR, generate_credentials, read_credentials
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.run_config import load_run_config
from runtime.rundir import RunInfo
from runtime.up import bus_roles, provision_streams


@dataclass
class RoleClient:
    """A connection as one role; `errors` collects what the server refused."""

    nc: Client
    role: str
    errors: list[str] = field(default_factory=list)

    async def publish(self, subject: str, data: bytes, msg_id: str | None = None) -> None:
        await self.nc.publish(subject, data, headers={"Nats-Msg-Id": msg_id} if msg_id else None)
        await self.nc.flush()

    async def js_publish(self, subject: str, data: bytes, msg_id: str | None = None, timeout: float = 2.0) -> bool:
        """A JetStream publish; False if the stream never acknowledged it (refused or not stored)."""
        try:
            await self.nc.jetstream().publish(subject, data, headers={"Nats-Msg-Id": msg_id} if msg_id else None,
                                              timeout=timeout)
        except (TimeoutError, nats.errors.Error) as e:
            self.errors.append(f"js publish to {subject}: {e!r}")
            return False
        return True

    async def refused(self, fragment: str, timeout_s: float = 5.0) -> bool:
        """Whether the server reported a permission violation mentioning `fragment` (case-insensitive)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if any("permissions violation" in e.lower() and fragment.lower() in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.05)
        return False


@contextlib.asynccontextmanager
async def connect_as(info: RunInfo, role: str) -> AsyncIterator[RoleClient]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    credentials = read_credentials(info.credentials_dir, role)
    nc = await nats.connect(info.nats_url, name=f"attacker-{role}", error_cb=on_error, allow_reconnect=False,
                            connect_timeout=5, **credentials.connect_options())
    try:
        yield RoleClient(nc, role, errors)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def connect_anonymously(url: str, **options: Any) -> Client:
    """A client without credentials (raises if the server refuses it, as it must when auth is on)."""

    async def quiet(e: Exception) -> None:
        return None

    return await nats.connect(url, name="attacker-anonymous", allow_reconnect=False, connect_timeout=5,
                              max_reconnect_attempts=0, error_cb=quiet, **options)


@contextlib.asynccontextmanager
async def default_run_bus(tmp_path: Path) -> AsyncIterator[tuple[Bus, RunInfo]]:
    """A server with the default run's roles (``python -m actors``), its streams, buckets and queues made by
    the supervisor role: that role's Bus, and the bus's address and credentials (a RunInfo without a run)."""
    rt = load_run_config([DEFAULT_RUN_FILE]).runtime
    users = generate_credentials(tmp_path / "credentials", bus_roles(rt))
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats", users=tuple(users))) as server:
        admin = await Bus.connect(server.url, "admin", credentials=read_credentials(tmp_path / "credentials",
                                                                                       SUPERVISOR))
        try:
            await admin.ensure_base()
            await provision_streams(admin, rt)
            yield admin, RunInfo("", server.url, "", "", 0, 0.0, str(tmp_path / "credentials"))
        finally:
            await admin.close()


class DroppingSubscription:
    """A subscription that loses the first message of one subject, as a route could: a watch or follow
    wrapped in it must notice the gap by sequence and read its stream again."""

    def __init__(self, sub: Any, subject: str) -> None:
        self._sub = sub
        self._subject = subject
        self.dropped = 0

    async def next_msg(self, timeout: float | None = None) -> Any:
        while True:
            msg = await self._sub.next_msg(timeout=timeout)
            if msg.subject == self._subject and not self.dropped:
                self.dropped += 1
                continue
            return msg

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()


@contextlib.asynccontextmanager
async def bus_as(info: RunInfo, role: str) -> AsyncIterator[Bus]:
    """A `Bus` signed in as ``role`` of the run (what an actor of that kind holds)."""
    bus = await Bus.connect(info.nats_url, role, **info.bus_options(role))
    try:
        yield bus
    finally:
        await bus.close()


def lose_first_message(monkeypatch: Any, bus: Bus, prefix: str, subject: str) -> list[DroppingSubscription]:
    """Makes the first subscription of ``bus`` to a subject starting with ``prefix`` lose the first message of
    ``subject``; the list holds that subscription once made (empty: none was)."""
    subscribe, dropping = bus.nc.subscribe, []

    async def lossy(to: str, **kwargs: Any) -> Any:
        sub = await subscribe(to, **kwargs)
        if to.startswith(prefix) and not dropping:
            dropping.append(DroppingSubscription(sub, subject))
            return dropping[0]
        return sub

    monkeypatch.setattr(bus.nc, "subscribe", lossy)
    return dropping
