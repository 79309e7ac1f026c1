"""Health checks of one supervised actor: is it alive, can it do its job, is it getting anywhere?

A process can be running and useless: its event loop wedged (or the process stopped), its engine dead
while the process lives, a handler that never returns. The supervisor restarts what exits; this finds
what does not exit, so that it is replaced too, and says why. Checks, on a clock of ``interval_s``:

- **liveness**: ``ctl.<kind>.<id>.ping`` answered within ``ping_timeout_s`` (the actor's event loop runs);
- **readiness**: every ``probe_every``-th check is ``ctl.<kind>.<id>.probe``: the kind's own probe (`Actor.probe`;
  the rollout actor decodes one token, the reward actor runs one sandboxed command), within
  ``probe_timeout_s``;
- **progress**: the ping's reply says how long the actor has held work without finishing any; more
  than ``stuck_s`` is a stuck actor (0: not checked). Passively, from the same replies: a handling in
  hand ``outlier_factor`` times longer than the p99 of the kind's recent ones (and at least
  ``outlier_min_s``) is stuck far outside its distribution, long before ``stuck_s`` (set above the
  slowest legitimate step) would say so;
- **errors** (passive): the share of handlings that failed over the last ``error_window`` checks above
  ``max_error_rate`` (once ``min_outcomes`` ended in that window): a process whose engine or sandboxes
  broke fails everything it takes, and every retry of that work lands on it again.

``max_failures`` failed checks in a row make the actor unhealthy (one slow answer on a loaded machine
is not a fault; a stuck actor is unhealthy at once). A process is first given ``start_grace_s`` to
answer at all: loading a model takes a while, and an actor that never answers in that time is unhealthy
too. Every decision is an event: ``health_check_failed`` per failure, ``health_check_recovered`` when a
check passes again after failing, ``actor_unhealthy`` once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog

from runtime.bus import Bus
from runtime.bus_auth import control_subject
from runtime.errors import BusTimeout, NoResponders
from runtime.registry import decode_registration, registration_key
from runtime.run_config import HealthSection

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Verdict:
    """Why an actor was found unhealthy."""

    check: str  # "liveness", "readiness", "progress", "errors" or "start"
    reason: str
    limit_s: float | None = None  # the time limit the actor passed, where the check has one

    @property
    def needs_kill(self) -> bool:
        """It answers nothing, or its work never ends: draining it would wait for what will not come."""
        return self.check in ("liveness", "progress")


async def _ask(bus: Bus, kind: str, actor_id: str, verb: str, timeout_s: float) -> dict[str, Any]:
    """One control request; a reply that is not ``ok`` raises with the actor's own words."""
    subject = control_subject(kind, actor_id, verb)
    try:
        reply = await bus.request(subject, b"", timeout_s=timeout_s)
    except BusTimeout:
        raise TimeoutError(f"no answer to {verb} within {timeout_s}s") from None
    except NoResponders:
        raise ConnectionError(f"nothing listens on {subject}") from None
    body = msgpack.unpackb(reply, raw=False)
    if not isinstance(body, dict) or not body.get("ok", False):
        raise RuntimeError(str(body.get("error") if isinstance(body, dict) else body))
    return body


async def watch(bus: Bus, kind: str, actor_id: str, cfg: HealthSection) -> Verdict:
    """Checks ``actor_id`` (of ``kind``) until it is unhealthy (the verdict is returned); cancel to stop."""
    if not await _until_running(bus, kind, actor_id, cfg.start_grace_s):
        return Verdict("start", f"not running (registered as consuming) within {cfg.start_grace_s}s of starting")
    failures = {"liveness": 0, "readiness": 0}  # in a row, per check: a frozen process fails pings first
    outcomes: collections.deque[tuple[int, int]] = collections.deque(maxlen=cfg.error_window + 1)
    for tick in itertools.count(1):
        await asyncio.sleep(cfg.interval_s)  # a checking clock: the next check is due interval_s after this one
        if bus.health.down.is_set():
            continue  # the bus is away: nobody can answer, which says nothing of this actor
        is_probe = cfg.probe_every > 0 and tick % cfg.probe_every == 0
        check = "readiness" if is_probe else "liveness"
        try:
            reply = await _ask(bus, kind, actor_id, "probe" if is_probe else "ping",
                               cfg.probe_timeout_s if is_probe else cfg.ping_timeout_s)
        except (OSError, RuntimeError, ValueError) as e:  # timeout, no responder, the bus; a refusal; not msgpack
            failures[check] += 1
            log.warning("health_check_failed", actor_id=actor_id, check=check, error=str(e) or repr(e),
                        num_failures=failures[check], max_failures=cfg.max_failures)
            if failures[check] >= cfg.max_failures:
                return Verdict(check, f"{failures[check]} {check} checks failed in a row; the last: {e}")
            continue
        if failures[check]:
            log.info("health_check_recovered", actor_id=actor_id, check=check, num_failures=failures[check])
        failures[check] = 0
        verdict = None if is_probe else _passive(reply, cfg, outcomes)  # a probe's reply carries no counts
        if verdict is not None:
            return verdict
    raise AssertionError("itertools.count does not end")


def _passive(reply: dict[str, Any], cfg: HealthSection,
             outcomes: collections.deque[tuple[int, int]]) -> Verdict | None:
    """The checks read from a ping's reply (what the actor counts and times of its own work)."""
    idle = float(reply.get("busy_without_progress_s", 0.0))
    if cfg.stuck_s and idle > cfg.stuck_s:
        return Verdict("progress", f"held work for {idle:.0f}s without finishing any (limit {cfg.stuck_s}s)",
                       cfg.stuck_s)
    oldest, p99 = float(reply.get("oldest_in_hand_s", 0.0)), float(reply.get("recent_handling_p99_s", 0.0))
    limit = max(cfg.outlier_factor * p99, cfg.outlier_min_s)
    if (cfg.outlier_factor and int(reply.get("num_recent_handlings", 0)) >= cfg.outlier_min_samples
            and oldest > limit):
        return Verdict("progress", f"a handling has run {oldest:.1f}s, over {limit:.1f}s ({cfg.outlier_factor:g}x "
                                   f"the p99 of its last {reply['num_recent_handlings']}: {p99:.3f}s)", limit)
    if not cfg.error_window:
        return None
    outcomes.append((int(reply.get("num_handled", 0)), int(reply.get("num_failed", 0))))
    (handled_then, failed_then), (handled_now, failed_now) = outcomes[0], outcomes[-1]
    failed, ended = failed_now - failed_then, handled_now - handled_then + failed_now - failed_then
    if ended >= cfg.min_outcomes and failed / ended > cfg.max_error_rate:
        return Verdict("errors", f"{failed} of the last {ended} handlings failed ({failed / ended:.0%}, limit "
                                 f"{cfg.max_error_rate:.0%}; see its handler_failed events)")
    return None


async def _until_running(bus: Bus, kind: str, actor_id: str, grace_s: float) -> bool:
    """Whether the actor's registry entry says it is running (or standing by) within ``grace_s`` (loading a
    model takes a while: checks start once it is ready). Event-driven: a watch of its registry entry."""
    key = registration_key(kind, actor_id)
    entries = bus.kv_watch("actors", key)
    try:
        async with asyncio.timeout(grace_s), contextlib.aclosing(entries):
            async for entry in entries:
                if entry is None or entry.deleted or not entry.value:
                    continue
                try:
                    if decode_registration(key, entry.value).get("state") in ("running", "standby"):
                        return True
                except ValueError:  # not (yet) an entry this reads: wait for the next write
                    continue
    except TimeoutError:
        return False
    return False
