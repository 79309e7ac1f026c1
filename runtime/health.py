"""Health checks of one supervised actor: is it alive, can it do its job, is it getting anywhere?

A process can be running and useless: its event loop wedged (or the process stopped), its engine dead
while the process lives, a handler that never returns. The supervisor restarts what exits; this finds
what does not exit, so that it is replaced too, and says why. Checks, on a clock of ``interval_s``:

- **liveness**: ``ctl.<kind>.<id>.ping`` answered within ``ping_timeout_s`` (the actor's event loop runs); a
  kind with a bound (the reconciler's: its lease) is unhealthy once no ping was answered for that long, and
  only then (``max_failures`` does not apply to it);
- **readiness**: every ``probe_every`` intervals, ``ctl.<kind>.<id>.probe``: the kind's own probe (`Actor.probe`;
  the rollout actor decodes one token, the reward actor runs one sandboxed command), within
  ``probe_timeout_s``, on its own clock: pings go on while a probe is in flight;
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
check passes again after failing, ``actor_unhealthy`` once. Checks end when the supervisor retires the actor
(swap, stop, finish: `Supervisor._retire`, bounded by its drain timeout, TERM and KILL): one leaving on purpose
stops answering before it exits, which is no failure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
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


async def watch(bus: Bus, kind: str, actor_id: str, cfg: HealthSection,
                unanswered_s: float | None = None) -> Verdict:
    """Checks ``actor_id`` (of ``kind``) until it is unhealthy (the verdict is returned); cancel to stop.

    Liveness and readiness keep their own clocks: a probe may take ``probe_timeout_s`` (60 s), and a frozen
    process must not go unnoticed behind it (pings that waited behind the probe in flight would find a frozen
    actor only when the probe timed out, 95 s later). ``unanswered_s`` (the kind's bound, e.g. the reconciler's
    lease): no ping answered for that long is unhealthy, however few or many pings that was (``max_failures``
    does not apply); pings then go every quarter of it, so that the bound is kept within a ping's interval."""
    if not await _until_running(bus, kind, actor_id, cfg.start_grace_s):
        return Verdict("start", f"not running (registered as consuming) within {cfg.start_grace_s}s of starting")
    async with asyncio.TaskGroup() as tg:
        checks = [tg.create_task(_liveness(bus, kind, actor_id, cfg, unanswered_s))]
        if cfg.probe_every > 0:
            checks.append(tg.create_task(_readiness(bus, kind, actor_id, cfg)))
        done, _ = await asyncio.wait(checks, return_when=asyncio.FIRST_COMPLETED)
        verdict = next(iter(done)).result()
        for check in checks:
            check.cancel()
    return verdict


async def _liveness(bus: Bus, kind: str, actor_id: str, cfg: HealthSection, unanswered_s: float | None) -> Verdict:
    """Pings on their own clock, and the passive checks read from their replies."""
    loop = asyncio.get_running_loop()
    every = cfg.interval_s if not unanswered_s else min(cfg.interval_s, unanswered_s / 4)
    timeout_s = cfg.ping_timeout_s if not unanswered_s else min(cfg.ping_timeout_s, every)
    outcomes: collections.deque[tuple[int, int]] = collections.deque(maxlen=cfg.error_window + 1)
    failures, answered_at = 0, loop.time()  # it was running (registered) just now
    while True:
        asked_at = loop.time()
        if bus.health.down.is_set():  # the bus is away: nobody can answer, which says nothing of this actor
            answered_at = asked_at  # nor does the time it was away count against it
        else:
            try:
                reply = await _ask(bus, kind, actor_id, "ping", timeout_s)
            except (OSError, RuntimeError, ValueError) as e:  # timeout, no responder, the bus; a refusal; not msgpack
                failures += 1
                silent_s = loop.time() - answered_at
                log.warning("health_check_failed", actor_id=actor_id, check="liveness", error=str(e) or repr(e),
                            num_failures=failures, max_failures=cfg.max_failures, unanswered_s=round(silent_s, 1))
                if unanswered_s:  # judged by the bound alone: its pings go 4 times as often, so max_failures of
                    # them span only part of it (a promoted spare busy taking the table over was killed by them)
                    if silent_s >= unanswered_s:
                        return Verdict("liveness", f"no ping answered for {silent_s:.1f}s (the kind's bound: "
                                                   f"{unanswered_s:g}s); the last failure: {e}", unanswered_s)
                elif failures >= cfg.max_failures:
                    return Verdict("liveness", f"{failures} liveness checks failed in a row; the last: {e}")
            else:
                if failures:
                    log.info("health_check_recovered", actor_id=actor_id, check="liveness", num_failures=failures)
                failures, answered_at = 0, asked_at
                if (verdict := _passive(reply, cfg, outcomes)) is not None:
                    return verdict
        # with a bound, a clock (due `every` after the last ping), so that the bound holds within one interval;
        # without, `interval_s` after each answer or failure, as ever: max_failures pings span what they always did
        await asyncio.sleep(max(0.0, asked_at + every - loop.time()) if unanswered_s else cfg.interval_s)


async def _readiness(bus: Bus, kind: str, actor_id: str, cfg: HealthSection) -> Verdict:
    """The kind's probe every ``probe_every`` ping intervals, however long each takes (within its timeout)."""
    failures = 0
    while True:
        await asyncio.sleep(cfg.interval_s * cfg.probe_every)
        if bus.health.down.is_set():
            continue
        try:
            await _ask(bus, kind, actor_id, "probe", cfg.probe_timeout_s)
        except (OSError, RuntimeError, ValueError) as e:
            failures += 1
            log.warning("health_check_failed", actor_id=actor_id, check="readiness", error=str(e) or repr(e),
                        num_failures=failures, max_failures=cfg.max_failures)
            if failures >= cfg.max_failures:
                return Verdict("readiness", f"{failures} readiness checks failed in a row; the last: {e}")
            continue
        if failures:
            log.info("health_check_recovered", actor_id=actor_id, check="readiness", num_failures=failures)
        failures = 0


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
