"""The supervisor: each actor its own OS process, restarted on crash under an intensity limit, drained
on stop, replaced on hot swap; the process placed by a backend (runtime.placement: a local subprocess,
or a Ray actor on a cluster), the policy here the same for every backend.

Restart strategy is OTP's one_for_one: a crashed process is restarted alone, after an exponential
backoff; more than ``max_restarts`` restarts within ``restart_window_s`` means something is wrong
beyond a restart's reach, so the run is reported failed and stopped cleanly.

Warm standby (``actors.<kind>.standby = N``): N more processes per kind are started and set up but
consume nothing; when an actor of the kind dies or is found unhealthy, a standby is activated in its
place at once (no backoff: it is ready) and a new standby is started behind it.

Stop order for one process: ``ctl.<kind>.<id>.drain`` (finish in-flight work, ack, hand over), then SIGTERM,
then SIGKILL. Children run in their own sessions with a parent-death signal: no orphans, ever.

A process lost with its node (a Ray node that died or left) is replaced at once on the nodes that
remain, outside the restart intensity (the node failed, not the actor: a node carrying six actors
would otherwise fail the run by itself); its registry entry is removed at once, so the reconciler
re-issues the work it held without waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import structlog

from runtime import health
from runtime.actor_launch import RunAddress
from runtime.bus import Bus, Inbound
from runtime.bus_auth import RunCredentials, control_subject
from runtime.errors import BusError, ConfigError
from runtime.local_backend import LocalBackend
from runtime.placement import PlacedProcess, PlacementBackend, PlacementError, UnplacedProcess, actor_launch
from runtime.registry import registration_key
from runtime.run_config import RuntimeConfig, import_entry
from runtime.run_state import Outcome

log = structlog.get_logger(__name__)

SUPERVISOR_SUBJECT = "ctl.supervisor"
FINISH_SUBJECT = f"{SUPERVISOR_SUBJECT}.finish"  # ends the run as finished: believed only as the durable state says
FINISH_CHECK_TIMEOUT_S = 30.0  # reading the state a finish is checked against (a table, one blob)
BUS_STEP_TIMEOUT_S = 5.0  # one registry write of the supervisor's; past it the bus is taken as down
ACTIVATE_TIMEOUT_S = 2.0  # a ready standby answers at once; one that does not is still loading


@dataclass
class ActorProcess:
    kind: str
    actor_id: str
    proc: PlacedProcess
    started_at: float = field(default_factory=time.time)
    retiring: bool = False  # drained on purpose (swap, stop, unhealthy): its exit is not a crash
    health: asyncio.Task[None] | None = None  # its health checks (runtime.health) and what a verdict sets off
    checks: asyncio.Task[health.Verdict] | None = None  # the checks alone: they end when it is retired
    standby: bool = False  # a warm spare, not consuming until activated
    rank: int = 0  # its rank in its kind's process group (actors.<kind>.ranks > 1), kept across restarts

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    def __init__(self, config: RuntimeConfig, run_dir: Path, bus: Bus, address: RunAddress,
                 backend: PlacementBackend | None = None, credentials: RunCredentials | None = None,
                 blob: Any = None, app: Any = None) -> None:
        self.config = config
        # the run's application config (what its actors get as ActorContext.config): a finish's check reads it
        self.app = app
        # the run's bus credentials, held from the start: every actor starts with them, whatever became
        # of their directory, which is written again when it lost or changed a file (`_keep_credentials`)
        self.credentials = credentials
        self.blob = blob  # the run's store (runtime.blob): what a finish request is checked against, with the bus
        self.run_dir = run_dir
        self.address = address  # what an actor process needs to find the run (runtime.actor_launch)
        self.bus = bus
        self.backend: PlacementBackend = backend or LocalBackend()
        self.procs: dict[str, ActorProcess] = {}
        self.outcome = Outcome.RUNNING
        self.failure: str | None = None
        self.unclean_exits: list[str] = []  # actors asked to stop that exited non-zero: "<id> exited <rc>"
        self.num_placed = 0  # processes the backend started: none by a failed run's end means nothing of it ran
        self._restarts: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._counter: collections.Counter[str] = collections.Counter()
        self._stop = asyncio.Event()
        self._draining = False  # `_shutdown` took its list of the processes to drain
        self._tg: asyncio.TaskGroup | None = None
        self._swap_lock = asyncio.Lock()
        classes = {kind: import_entry(spec.entry) for kind, spec in config.actors.items()}
        # the kinds whose role may ask to finish the run: one of them must confirm a request (Actor.why_not_finished)
        self._finishers = [cls for cls in classes.values() if FINISH_SUBJECT in cls.required_access().publish]
        # per kind, how long its pings may go unanswered before it is replaced (None: health.max_failures pings)
        self._unanswered_s = {kind: config.actors[kind].lease_s if cls.replaced_within_lease else None
                              for kind, cls in classes.items()}
        self.num_refused_finishes = 0
        self._single = {kind: cls.max_count == 1 for kind, cls in classes.items()}

    # --- lifecycle ----------------------------------------------------------------------------------
    async def run(self) -> Outcome:
        """Starts every configured actor and supervises until stopped; returns how the run ended."""
        ctl = await self.bus.subscribe(f"{SUPERVISOR_SUBJECT}.*", self._on_ctl)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                await self._spawn_together([(kind, rank) for kind, spec in self.config.actors.items()
                                            for _ in range(spec.count) for rank in range(spec.ranks)])
                # spares after the actors, so that a spare never holds the resources an actor waits for
                await self._spawn_together([(kind, 0) for kind, spec in self.config.actors.items()
                                            for _ in range(spec.standby)], standby=True)
                await self._stop.wait()
                await self._shutdown()
        finally:
            await ctl.unsubscribe()  # bounded, and quiet on a closed connection: nothing to undo
        log.info("supervisor_stopped", outcome=self.outcome.value, failure=self.failure)
        return self.outcome

    def request_stop(self, outcome: Outcome = Outcome.STOPPED, failure: str | None = None) -> None:
        if self.outcome is Outcome.RUNNING:
            self.outcome = outcome
            self.failure = failure
        self._stop.set()

    async def _shutdown(self) -> None:
        procs = list(self.procs.values())
        self._draining = True  # a process placed from now on is retired as soon as it is (`_spawn`)
        log.info("supervisor_draining", num_actors=len(procs))
        async with asyncio.TaskGroup() as tg:
            for p in procs:
                tg.create_task(self._retire(p))

    # --- processes ------------------------------------------------------------------------------------
    async def _spawn_together(self, starts: list[tuple[str, int]], standby: bool = False) -> list[ActorProcess]:
        """Starts one process per ``(kind, rank)`` at once: each placement is independent (on Ray each
        waits for its own worker, bounded by ``runtime.ray_place_timeout_s``), so n starts take about as
        long as the slowest, not the sum. A start that raises cancels the others (each cleans up)."""
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._spawn(kind, standby=standby, rank=rank)) for kind, rank in starts]
        return [t.result() for t in tasks]

    async def _spawn(self, kind: str, standby: bool = False, rank: int = 0) -> ActorProcess:
        assert self._tg is not None
        spec = self.config.actors[kind]
        self._counter[kind] += 1
        actor_id = f"{kind}-{self._counter[kind]}-{os.urandom(2).hex()}"
        log.info("actor_starting", actor_kind=kind, actor_id=actor_id, standby=standby)  # its start-up from here
        proc: PlacedProcess
        self._keep_credentials()
        try:
            launch = actor_launch(self.address, self.run_dir, kind, actor_id, spec, rank=rank, standby=standby,
                                  credentials=self.credentials)
            proc = await self.backend.start(launch, spec)
            self.num_placed += 1
        except (PlacementError, ConfigError, OSError) as e:  # a failed start is a crash: restarted with
            # backoff, within the intensity, and its reason is the run's failure if it comes to that
            error = PlacementError(f"{type(e).__name__}: {e}" if str(e) else repr(e))
            log.error("actor_not_placed", actor_kind=kind, actor_id=actor_id, error=str(error))
            proc = UnplacedProcess(error)
        ap = ActorProcess(kind, actor_id, proc, standby=standby, rank=rank)
        self.procs[actor_id] = ap
        log.info("actor_spawned", actor_kind=kind, actor_id=actor_id, pid=proc.pid, node=proc.node, standby=standby)
        self._tg.create_task(self._watch(ap))
        if self._draining:  # a restart or replacement whose placement outlasted the stop's start: the drain's
            # list was taken without it, and nothing else would ever stop it (the run would wait on it forever)
            log.info("actor_retired_on_start", actor_kind=kind, actor_id=actor_id, reason="the run is stopping")
            self._tg.create_task(self._retire(ap))
        elif self.config.health.interval_s > 0:
            ap.health = self._tg.create_task(self._check_health(ap))
        return ap

    def _keep_credentials(self) -> None:
        """Writes the run's credentials directory again if a file of it is missing or changed (deleted
        mid-run: ops commands and processes started by hand read it); said either way."""
        if self.credentials is None:
            return
        try:
            restored = self.credentials.restore()
        except OSError as e:  # the actors still start: they take the credentials from the supervisor
            log.error("credentials_not_restored", directory=str(self.credentials.directory), error=repr(e),
                      fix=f"make {self.credentials.directory} writable by the run's user; the supervisor "
                          "writes it again when it next starts an actor")
            return
        if restored:
            log.warning("credentials_restored", directory=str(self.credentials.directory), roles=restored,
                        reason="their files were missing or changed")

    async def _watch(self, ap: ActorProcess) -> None:
        rc = await ap.proc.wait()
        self.procs.pop(ap.actor_id, None)
        if ap.health is not None:
            ap.health.cancel()
        bus_down = self.bus.health.down.is_set()
        if rc != 0 and not bus_down:  # a killed process cannot unregister itself: drop its entry for it
            await self._deregister(ap)
        if ap.retiring or self._stop.is_set():
            log.info("actor_exited", actor_kind=ap.kind, actor_id=ap.actor_id, pid=ap.pid, returncode=rc)
            if rc != 0:  # asked to stop, it did not stop cleanly: say so, not only "stopped"
                log.error("actor_stopped_uncleanly", actor_kind=ap.kind, actor_id=ap.actor_id, returncode=rc,
                          log_file=ap.proc.output_tail())
                self.unclean_exits.append(f"{ap.actor_id} exited {rc} (see logs/{ap.actor_id}.out)")
            return
        if bus_down:
            await self._restart_after_outage(ap, rc)
            return
        if ap.proc.lost is not None:
            await self._replace_lost(ap)
            return
        num_recent = self._count_restart(ap, exit_reason(rc, ap.proc))
        log.error("actor_crashed", actor_kind=ap.kind, actor_id=ap.actor_id, pid=ap.pid, returncode=rc,
                  reason=exit_reason(rc, ap.proc), num_recent_restarts=num_recent, log_file=ap.proc.output_tail())
        if self._stop.is_set():
            return
        if not ap.standby and await self._promote(ap.kind, ap.actor_id):
            return
        delay = self.config.supervisor.backoff(num_recent)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)
        if self._stop.is_set():
            return
        new = await self._spawn(ap.kind, standby=ap.standby, rank=ap.rank)
        log.info("actor_restarted", actor_kind=ap.kind, old_id=ap.actor_id, new_id=new.actor_id, after_s=delay,
                 standby=ap.standby)

    async def _promote(self, kind: str, replaces: str) -> ActorProcess | None:
        """A ready standby of ``kind`` activated in place of ``replaces`` (and a new standby started behind
        it), or None when the kind has none ready (the caller starts a process cold)."""
        for ap in [p for p in self.procs.values() if p.kind == kind and p.standby and not p.retiring]:
            try:
                reply = await self.bus.request(control_subject(kind, ap.actor_id, "activate"), b"",
                                               timeout_s=ACTIVATE_TIMEOUT_S)
                ok = bool(msgpack.unpackb(reply, raw=False).get("ok"))
            except (OSError, ValueError) as e:  # BusError included: not ready yet (still loading), or gone
                log.info("standby_not_activated", actor_kind=kind, actor_id=ap.actor_id, error=repr(e))
                continue
            if not ok:
                continue
            ap.standby = False
            log.info("standby_promoted", actor_kind=kind, actor_id=ap.actor_id, replaces=replaces)
            await self._spawn(kind, standby=True)
            return ap
        return None

    def _count_restart(self, ap: ActorProcess, reason: str = "found unhealthy (see actor_unhealthy)") -> int:
        """One more restart of ``ap``'s kind within the window; past the intensity limit the run fails
        (it stops: the caller sees ``_stop`` set). Returns the number of recent restarts."""
        now = time.monotonic()
        recent = self._restarts[ap.kind]
        recent.append(now)
        sup = self.config.supervisor
        while recent and now - recent[0] > sup.restart_window_s:
            recent.popleft()
        if len(recent) > sup.max_restarts:
            reason = (f"{ap.kind} crashed {len(recent)} times within {sup.restart_window_s}s "  # unhealthy counts too
                      f"(limit {sup.max_restarts}), the last: {reason}; see {ap.proc.output_tail()}")
            log.error("restart_intensity_exceeded", actor_kind=ap.kind, num_restarts=len(recent),
                      window_s=sup.restart_window_s, max_restarts=sup.max_restarts)
            self.request_stop(Outcome.FAILED, reason)
        return len(recent)

    async def _check_health(self, ap: ActorProcess) -> None:
        """Health checks while ``ap`` runs; an unhealthy one is replaced: its successor is started first
        (capacity comes back as soon as it can), then it is killed at once if it answers nothing or its
        work never ends, else drained, signalled, killed as on a stop. Its work in hand goes back to the
        queue when it dies unacknowledged, or is re-issued when its lease lapses."""
        ap.checks = checks = asyncio.create_task(
            health.watch(self.bus, ap.kind, ap.actor_id, self.config.health, self._unanswered_s[ap.kind]))
        try:
            await asyncio.wait({checks})  # not cancelled with it by `_retire`: that ends the checks, not this task
        finally:
            checks.cancel()  # this task cancelled (the process exited): its checks end with it
        if checks.cancelled():  # ended by `_retire`
            return
        verdict = checks.result()
        if ap.retiring or self._stop.is_set() or ap.actor_id not in self.procs:
            return
        num_recent = self._count_restart(ap)
        log.error("actor_unhealthy", actor_kind=ap.kind, actor_id=ap.actor_id, pid=ap.pid, check=verdict.check,
                  reason=verdict.reason, limit_s=verdict.limit_s, num_recent_restarts=num_recent)
        if self._stop.is_set():
            return
        new = (None if ap.standby else await self._promote(ap.kind, ap.actor_id)) or await self._spawn(
            ap.kind, standby=ap.standby, rank=ap.rank)
        log.info("actor_replaced", actor_kind=ap.kind, old_id=ap.actor_id, new_id=new.actor_id,
                 check=verdict.check)
        if verdict.needs_kill:
            ap.retiring = True
            await self._kill(ap, reason=verdict.check)
        else:
            await self._retire(ap)

    async def _restart_after_outage(self, ap: ActorProcess, rc: int) -> None:
        """An actor that died while the bus was down (most likely of it) is restarted once the bus is back,
        outside the restart intensity: no restart could connect before, and counting these would fail the
        run for the bus's fault under the actor's name. The bus guard bounds the wait (bus.max_outage_s)."""
        log.error("actor_crashed_during_bus_outage", actor_kind=ap.kind, actor_id=ap.actor_id, pid=ap.pid,
                  returncode=rc, log_file=ap.proc.output_tail())
        stop = asyncio.ensure_future(self._stop.wait())
        back = asyncio.ensure_future(self.bus.health.up.wait())
        try:
            await asyncio.wait({stop, back}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            back.cancel()
        if self._stop.is_set():
            return
        await self._deregister(ap)
        new = await self._spawn(ap.kind, standby=ap.standby, rank=ap.rank)
        log.info("actor_restarted", actor_kind=ap.kind, old_id=ap.actor_id, new_id=new.actor_id, after="bus outage")

    async def _replace_lost(self, ap: ActorProcess) -> None:
        """A process lost with its node: a standby of its kind takes its place, else a new process is placed
        at once on the nodes that remain (its entry was removed by `_watch`: its work is re-issued)."""
        log.error("actor_lost_with_node", actor_kind=ap.kind, actor_id=ap.actor_id, node=ap.proc.node,
                  reason=ap.proc.lost, standby=ap.standby)
        new = (None if ap.standby else await self._promote(ap.kind, ap.actor_id)) or await self._spawn(
            ap.kind, standby=ap.standby, rank=ap.rank)
        log.info("actor_replaced", actor_kind=ap.kind, old_id=ap.actor_id, new_id=new.actor_id,
                 old_node=ap.proc.node, new_node=new.proc.node, check="node_lost")

    async def _deregister(self, ap: ActorProcess) -> None:
        try:
            async with asyncio.timeout(BUS_STEP_TIMEOUT_S):
                await self.bus.kv_delete("actors", registration_key(ap.kind, ap.actor_id))
        except OSError as e:  # BusError included; the bus dropped meanwhile: its entry stays, said
            log.warning("registry_entry_left", actor_id=ap.actor_id, error=repr(e))

    async def _retire(self, ap: ActorProcess) -> None:
        """Drain, then TERM, then KILL: whatever it takes, the process is gone when this returns."""
        ap.retiring = True
        # Its health checks end here: on its way out it stops answering pings before its process exits, and each
        # unanswered one was a failed liveness check (a warning) with nothing for a person to do; this retirement
        # has its own bounds (drain timeout, TERM, KILL), and a verdict on a retiring actor was ignored anyway.
        if ap.checks is not None:
            ap.checks.cancel()
            await asyncio.wait({ap.checks})  # ended before the drain request: no ping of theirs meets it leaving
        sup = self.config.supervisor
        drain_timeout = self.config.actors[ap.kind].drain_timeout_s
        try:
            if self.bus.health.down.is_set():  # no request can reach it: go straight to the signal
                raise BusError("the bus is reconnecting")
            await self.bus.request(control_subject(ap.kind, ap.actor_id, "drain"), b"", timeout_s=2.0)
        except OSError:  # BusError included: not listening (starting, wedged, bus down): SIGTERM drains too
            with contextlib.suppress(ProcessLookupError):
                ap.proc.send_signal(signal.SIGTERM)
        if await _wait_exit(ap.proc, drain_timeout):
            return
        log.warning("actor_drain_timeout", actor_id=ap.actor_id, timeout_s=drain_timeout)
        with contextlib.suppress(ProcessLookupError):
            ap.proc.send_signal(signal.SIGTERM)
        if await _wait_exit(ap.proc, sup.term_timeout_s):
            return
        await self._kill(ap, reason="stop_timeout")

    async def _kill(self, ap: ActorProcess, reason: str) -> None:
        """SIGKILL to the process's whole session (its sandboxes too), then its exit."""
        log.error("actor_killed", actor_id=ap.actor_id, pid=ap.pid, reason=reason)
        await ap.proc.kill()

    # --- hot swap --------------------------------------------------------------------------------------
    async def swap(self, kind: str) -> dict[str, Any]:
        """Replaces every process of ``kind`` with one running the code now on disk, without loss."""
        if kind not in self.config.actors:
            raise ValueError(f"unknown actor kind {kind!r}; this run has {sorted(self.config.actors)}")
        if self.config.actors[kind].ranks > 1:  # a second group beside the first would take its rendezvous
            raise ValueError(f"{kind} runs as a group of {self.config.actors[kind].ranks} ranks: hot swap replaces "
                             "single processes; stop the run and resume it (--resume) to change its code")
        async with self._swap_lock:
            old = [p for p in self.procs.values() if p.kind == kind and not p.retiring and not p.standby]
            old_spares = [p for p in self.procs.values() if p.kind == kind and not p.retiring and p.standby]
            old_info = [await self._registry_entry(p) for p in old]
            log.info("swap_started", actor_kind=kind, old=[p.actor_id for p in old])
            if self._single[kind]:  # one process at a time (a second fences the first): the old one goes first
                for p in old:
                    await self._retire(p)
            new = await self._spawn_together([(kind, 0)] * max(1, len(old)))
            new_info = [await self._wait_running(p) for p in new]
            for p in [] if self._single[kind] else old:
                await self._retire(p)
            for p in old_spares:  # spares run the old code too: new ones take their place
                await self._retire(p)
                await self._spawn(kind, standby=True)
            report = {"kind": kind, "old": _hashes(old, old_info), "new": _hashes(new, new_info)}
            log.info("swap_finished", actor_kind=kind, old=report["old"], new=report["new"])
            return report

    async def _registry_entry(self, ap: ActorProcess) -> dict[str, Any]:
        entry = await self.bus.kv_get("actors", registration_key(ap.kind, ap.actor_id))
        if entry is None or not entry.value:  # not registered (yet): no code hash to report
            return {}
        return msgpack.unpackb(entry.value, raw=False)

    async def _wait_running(self, ap: ActorProcess) -> dict[str, Any]:
        timeout = self.config.supervisor.ready_timeout_s
        try:
            entries = self.bus.kv_watch("actors", registration_key(ap.kind, ap.actor_id))
            async with asyncio.timeout(timeout), contextlib.aclosing(entries):
                async for entry in entries:
                    if ap.proc.returncode is not None:
                        raise RuntimeError(f"replacement {ap.actor_id} exited with {ap.proc.returncode}")
                    if entry is None or entry.deleted or not entry.value:
                        continue
                    info = msgpack.unpackb(entry.value, raw=False)
                    if info.get("state") == "running":
                        return info
        except TimeoutError:
            raise RuntimeError(f"replacement {ap.actor_id} was not consuming within {timeout}s") from None
        raise RuntimeError(f"registry watch for {ap.actor_id} ended early")

    # --- control -----------------------------------------------------------------------------------------
    async def _on_ctl(self, raw: Inbound) -> None:
        verb = raw.subject.rsplit(".", 1)[-1]
        try:
            body = msgpack.unpackb(raw.data, raw=False) if raw.data else {}
        except Exception:  # msgpack raises several unrelated types
            body = None
        if not isinstance(body, dict):  # a malformed request gets an answer, not an exception in a callback
            await self.bus.respond(raw, msgpack.packb({"ok": False, "error": "the request body must be a msgpack map"}))
            return
        if verb == "swap":
            assert self._tg is not None
            self._tg.create_task(self._reply_swap(raw, str(body.get("kind", ""))))
            return
        if verb == "status":
            reply: dict[str, Any] = {"ok": True, "outcome": self.outcome.value,
                                     "num_refused_finishes": self.num_refused_finishes, "actors": [
                {"id": p.actor_id, "kind": p.kind, "pid": p.pid, "node": p.proc.node, "retiring": p.retiring,
                 "standby": p.standby, "uptime_s": round(time.time() - p.started_at, 1)} for p in self.procs.values()]}
        elif verb == "stop":
            self.request_stop(Outcome.STOPPED)
            reply = {"ok": True}
        elif verb == "finish":
            assert self._tg is not None  # reading the state may take a while: not in the subscription's callback
            self._tg.create_task(self._reply_finish(raw, body))
            return
        else:
            reply = {"ok": False, "error": f"unknown verb {verb!r}; use swap, status, stop or finish"}
        await self.bus.respond(raw, msgpack.packb(reply, use_bin_type=True))

    async def _reply_finish(self, raw: Inbound, body: dict[str, Any]) -> None:
        """Ends the run as finished if a kind that may say so confirms it from the durable state; else refuses,
        counts and says why (the run goes on: a stop is an operator's, ``ctl.supervisor.stop``)."""
        why = await self._why_not_finished(body)
        if why is None:
            log.info("run_finish_requested", by=body.get("by"), reason=body.get("reason"), version=body.get("version"))
            self.request_stop(Outcome.FINISHED)
            reply: dict[str, Any] = {"ok": True}
        else:
            self.num_refused_finishes += 1
            log.warning("run_finish_refused", by=body.get("by"), reason=body.get("reason"),
                        version=body.get("version"), why=why, num_refused=self.num_refused_finishes)
            reply = {"ok": False, "error": f"the run is not finished: {why}"}
        await self.bus.respond(raw, msgpack.packb(reply, use_bin_type=True))

    async def _why_not_finished(self, body: dict[str, Any]) -> str | None:
        if not self._finishers:
            return "no actor kind of this run may end it (none publishes ctl.supervisor.finish)"
        reasons = []
        for cls in self._finishers:
            try:
                async with asyncio.timeout(FINISH_CHECK_TIMEOUT_S):
                    why = await cls.why_not_finished(self.bus, self.blob, self.config.run, self.app, body)
            except Exception as e:  # the bus, the store, a record unreadable: unconfirmed, never believed (nor fatal)
                why = f"the run's state could not be read ({e!r}); ask again"
            if why is None:
                return None
            reasons.append(f"{cls.kind}: {why}")
        return "; ".join(reasons)

    async def _reply_swap(self, raw: Inbound, kind: str) -> None:
        try:
            reply: dict[str, Any] = {"ok": True, **await self.swap(kind)}
        except (ValueError, RuntimeError) as e:
            log.error("swap_failed", actor_kind=kind, error=str(e))
            reply = {"ok": False, "error": str(e)}
        await self.bus.respond(raw, msgpack.packb(reply, use_bin_type=True))


def open_backend(config: RuntimeConfig, run_dir: Path) -> PlacementBackend:
    """The placement backend ``config.runtime.backend`` names (Ray imported only when it is asked for).

    Raises:
        PlacementError: the Ray cluster cannot be reached.
    """
    if config.runtime.backend == "ray":
        from runtime.ray_backend import RayBackend

        return RayBackend.connect(config.runtime, run_dir)
    return LocalBackend.for_run(config, run_dir)


def exit_reason(rc: int, proc: PlacedProcess) -> str:
    """Why a process ended, never empty: its signal or exit status, and the last line it wrote (a local
    process's output file; a remote one's tail comes with `output_tail`)."""
    if isinstance(proc, UnplacedProcess):
        return f"not started: {proc.error}"
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
        return f"killed by signal {-rc}"
    last = ""
    with contextlib.suppress(OSError, ValueError), open(proc.output_tail(), "rb") as out:
        out.seek(max(0, out.seek(0, os.SEEK_END) - 4096))
        lines = [line.strip() for line in out.read().decode(errors="replace").splitlines() if line.strip()]
        last = lines[-1][:500] if lines else ""
    return f"exited {rc}" + (f": {last}" if last else " without a word (see its output file)")


async def _wait_exit(proc: PlacedProcess, timeout: float) -> bool:
    try:
        await asyncio.wait_for(proc.wait(), timeout)
        return True
    except TimeoutError:
        return False


def _hashes(procs: list[ActorProcess], infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": p.actor_id, "code_hash": i.get("code_hash")} for p, i in zip(procs, infos, strict=True)]
