"""A sign-in the bus refuses: on the first connect, one BusAuthRefused naming the credentials (nats-py's own
errors are not repeated); on a reconnect later (credentials rotated, a server restarted with other users), an
error event naming the cause and the fix each time it is refused, never silently.

nats-py's client is replaced by a double that reports its errors as nats-py does, through ``error_cb``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from runtime import bus as bus_mod
from runtime.bus import Bus, BusAuthRefused
from runtime.bus_auth import BusCredentials

REFUSED = "nats: 'Authorization Violation'"


class Client:
    """Connects at once, or is refused while connecting (``refuse_first``: it then never returns)."""

    refuse_first = False

    def __init__(self) -> None:
        self.error_cb: Any = None
        self.connected_url = None

    async def connect(self, servers: list[str], *, error_cb: Any, **options: Any) -> None:
        self.error_cb = error_cb
        if self.refuse_first:
            await error_cb(Exception(REFUSED))
            await asyncio.Event().wait()  # nats-py would go on retrying

    def jetstream(self) -> None:
        return None

    async def close(self) -> None:
        pass


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> list[Client]:
    made: list[Client] = []

    def make() -> Client:
        made.append(Client())
        return made[-1]

    monkeypatch.setattr(bus_mod, "BusClient", make)
    return made


async def test_a_reconnect_refused_after_connecting_is_said_with_its_cause_and_fix(client: list[Client]) -> None:
    await Bus.connect("nats://127.0.0.1:4222", name="rollout-1", credentials=BusCredentials("rollout", "old"))
    with capture_logs() as logs:
        await client[0].error_cb(Exception(REFUSED))  # the server restarted with rotated passwords
    (event,) = [e for e in logs if e["event"] == "bus_sign_in_refused"]
    assert event["log_level"] == "error" and event["role"] == "rollout" and event["client"] == "rollout-1"
    assert "rotated" in event["reason"] and "credentials" in event["fix"]


async def test_a_first_connect_refused_raises_once_and_logs_nothing_more(
        client: list[Client], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Client, "refuse_first", True)
    with capture_logs() as logs, pytest.raises(BusAuthRefused, match="refused the credentials of role 'rollout'"):
        await Bus.connect("nats://127.0.0.1:4222", name="rollout-1", credentials=BusCredentials("rollout", "x"))
    assert not [e for e in logs if e["event"] in ("bus_sign_in_refused", "nats_client_error")], logs
