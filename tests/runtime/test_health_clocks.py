"""Liveness and readiness keep their own clocks: while the kind's probe is in flight (it may
take 60 s), pings go on, so a process that freezes meanwhile is found by them, not by the probe's timeout. And a
kind's bound on unanswered pings (the reconciler's lease) holds however few pings fit in it.

A bus double answering control requests as a scripted actor would (this unit is `runtime.health` alone; the real
processes are in tests/integration/test_health.py and test_actor_leases.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgpack

from runtime import health
from runtime.errors import BusTimeout, NoResponders
from runtime.run_config import HealthSection
from tests.runtime.registry_entry import running_entry


class ScriptedActor:
    """Answers pings at once until ``freeze_at`` (seconds after start), never after; a probe never answers."""

    def __init__(self, freeze_at: float) -> None:
        self.started = time.monotonic()
        self.freeze_at = freeze_at
        self.health = SimpleNamespace(down=asyncio.Event())
        self.probes_in_flight = 0
        self.pings_during_probe = 0
        self.pings: list[float] = []

    def kv_watch(self, bucket: str, key: str) -> AsyncIterator[Any]:
        return running_entry("reconciler", "reconciler-1-abcd", 1)

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        verb = subject.rsplit(".", 1)[-1]
        if verb == "probe":
            self.probes_in_flight += 1
            try:
                await asyncio.sleep(timeout_s)
            finally:
                self.probes_in_flight -= 1
            raise BusTimeout(f"no reply on {subject}")
        now = time.monotonic() - self.started
        self.pings.append(now)
        self.pings_during_probe += self.probes_in_flight > 0
        if now >= self.freeze_at:
            await asyncio.sleep(timeout_s)
            raise BusTimeout(f"no reply on {subject}")
        return msgpack.packb({"ok": True, "state": "running", "busy_without_progress_s": 0.0})


async def test_pings_go_on_while_a_probe_is_in_flight_and_find_a_freeze() -> None:
    # the probe is due at 0.3 s and would time out at 30.3 s; the process freezes at 0.6 s
    cfg = HealthSection(interval_s=0.1, ping_timeout_s=0.1, probe_every=3, probe_timeout_s=30.0, max_failures=3,
                        start_grace_s=5.0)
    actor = ScriptedActor(freeze_at=0.6)
    async with asyncio.timeout(20):
        verdict = await health.watch(actor, "reconciler", "reconciler-1-abcd", cfg)  # type: ignore[arg-type]
    found_after = time.monotonic() - actor.started
    assert verdict.check == "liveness" and verdict.needs_kill, verdict
    assert actor.pings_during_probe >= 3, "pings kept their clock while the probe was in flight"
    # 3 failed pings after the freeze: about 1 s (a loaded machine's slack up to 10 s); the probe would take 30 s
    assert found_after < 10.0, f"found {found_after:.1f}s after start, not by the probe's timeout"
    assert actor.probes_in_flight == 0, "the probe in flight is cancelled with the verdict"


async def test_a_kind_s_bound_on_unanswered_pings_holds_with_fewer_than_max_failures() -> None:
    # one ping per 5 s and 3 failures would take 15 s and more; the kind's bound is 1 s
    cfg = HealthSection(interval_s=5.0, ping_timeout_s=5.0, probe_every=0, max_failures=3, start_grace_s=5.0)
    actor = ScriptedActor(freeze_at=0.5)
    async with asyncio.timeout(20):
        verdict = await health.watch(actor, "reconciler", "reconciler-1-abcd", cfg,  # type: ignore[arg-type]
                                     unanswered_s=1.0)
    found_after = time.monotonic() - actor.started
    assert verdict.check == "liveness" and verdict.limit_s == 1.0 and "no ping answered" in verdict.reason
    # its last answer + the bound + a ping's interval (0.25 s), with a loaded machine's slack; 3 pings: 15 s
    assert 1.0 <= found_after < 5.0, found_after



class SilentWhileActivating(ScriptedActor):
    """Not subscribed (no responders, at once) from ``silent[0]`` to ``silent[1]``: a spare taking over, as a
    promoted reconciler did while it took the slot table over; answers between; frozen from ``freeze_at``."""

    def __init__(self, silent: tuple[float, float], freeze_at: float) -> None:
        super().__init__(freeze_at)
        self.silent = silent

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        now = time.monotonic() - self.started
        if self.silent[0] <= now < self.silent[1]:
            self.pings.append(now)
            raise NoResponders(f"no responders on {subject}")
        return await super().request(subject, data, timeout_s)


async def test_with_a_bound_only_the_bound_judges_not_max_failures() -> None:
    # pings every 0.5 s (a quarter of the 2 s bound): 3 failures in 1.5 s of silence made the verdict before
    cfg = HealthSection(interval_s=5.0, ping_timeout_s=5.0, probe_every=0, max_failures=3, start_grace_s=5.0)
    actor = SilentWhileActivating(silent=(0.2, 1.9), freeze_at=3.0)
    async with asyncio.timeout(20):
        verdict = await health.watch(actor, "reconciler", "reconciler-1-abcd", cfg,  # type: ignore[arg-type]
                                     unanswered_s=2.0)
    found_after = time.monotonic() - actor.started
    assert sum(0.2 <= t < 1.9 for t in actor.pings) >= cfg.max_failures, "the silence spanned max_failures pings"
    assert "no ping answered" in verdict.reason, verdict
    assert found_after >= 3.0 + 2.0 - 0.5, f"judged {found_after:.1f}s after start, within the silence it survived"
