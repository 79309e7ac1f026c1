"""The Actor base class: a durable JetStream consumer with an explicit lifecycle.

    CREATED -> STARTING -> [STANDBY ->] RUNNING -> DRAINING -> STOPPED

An actor kind declares the queues it consumes, the message types it accepts, and (optionally) the
configuration dataclass of its section. The base feeds at most ``max_concurrency`` handlers from the
queue's durable pull consumer (shared by every actor of the kind), acks after success, naks with
exponential backoff on failure, heartbeats ``in_progress`` while a handler runs, acks (at info) work its
handler drops on purpose (`runtime.errors.WorkDropped`), and dead-letters messages it cannot decode.
Drain = stop fetching, finish in-flight handlers and every task they started, ack, flush, hand over
state, stop (docs/ARCHITECTURE.md, "Actor lifecycle").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import socket
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import structlog

from runtime import actor_metrics
from runtime import config as config_mod
from runtime.backoff import doubling
from runtime.bus import Bus, BusLimits, Inbound, Queue, WorkMessage
from runtime.bus_auth import BusAccess, control_subject
from runtime.codec import Codec, Message
from runtime.errors import ActorFailed, ConfigError, LifecycleError, MessageError, WorkDropped
from runtime.registry import handover_key, registration_key
from runtime.work_timing import WorkTiming

log = structlog.get_logger(__name__)

PROBE_TIMEOUT_S = 60.0  # a probe that takes longer is a failed one (runtime.health asks within its own bound)


class ActorState(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    STANDBY = "standby"  # set up (model loaded, sandboxes warm), not consuming: a warm spare
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ActorIdentity:
    kind: str
    actor_id: str
    pid: int
    host: str
    code_hash: str

    @classmethod
    def here(cls, kind: str, actor_id: str, code_hash: str) -> ActorIdentity:
        return cls(kind, actor_id, os.getpid(), socket.gethostname(), code_hash)


@dataclass(frozen=True)
class ActorSettings:
    """How the base runs an actor; one per kind, from the runtime configuration."""

    max_concurrency: int = 8
    heartbeat_s: float = 5.0  # in_progress interval; must stay well below the bus's ack_wait
    fetch_timeout_s: float = 0.5  # bounds how long a drain waits for a pending fetch
    nak_base_delay_s: float = 0.5
    nak_max_delay_s: float = 30.0
    drain_timeout_s: float = 60.0
    stop_step_timeout_s: float = 5.0  # each bus step of stopping (deregister, handover, flush)
    max_deliveries: int = 5  # handlings of one message before it is dead-lettered with its last error
    lease_s: float = 10.0  # the registry entry is renewed every third of this; readers take it for lost after

    def __post_init__(self) -> None:
        if not 1 <= self.max_deliveries < BusLimits().max_deliver:
            raise ValueError(f"max_deliveries={self.max_deliveries} must be in 1..{BusLimits().max_deliver - 1}: "
                             "below the consumer's max_deliver, where the server stops delivering silently")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1")
        if self.heartbeat_s <= 0 or self.fetch_timeout_s <= 0:
            raise ValueError("heartbeat_s and fetch_timeout_s must be > 0")

    def nak_delay(self, num_delivered: int) -> float:
        return doubling(self.nak_base_delay_s, self.nak_max_delay_s, num_delivered - 1)


@dataclass(frozen=True)
class Delivery:
    """What a handler knows about the message it handles: enough to be idempotent."""

    queue: str
    subject: str
    stream_seq: int
    num_delivered: int
    msg_id: str | None
    task_group: asyncio.TaskGroup  # tasks a handler starts belong here and finish before the ack

    @property
    def redelivered(self) -> bool:
        return self.num_delivered > 1


@dataclass
class ActorContext:
    """Everything an actor gets from its process: identity, bus, storage, configuration."""

    identity: ActorIdentity
    bus: Bus
    settings: ActorSettings
    config: Any  # the actor kind's Config instance, or None
    blob: Any = None  # runtime.blob.BlobStore
    run_dir: Any = None
    run: Any = None  # runtime.run_config.RunSection: the run's name, seed and step budget
    run_id: str = ""  # the run's id (runtime.run_state): stable across resumes, whatever the directory
    ready_samples: Any = None  # runtime.ready_samples.ReadySamples under the Ray backend, else None

    @property
    def run_steps(self) -> int:
        """The run's step budget, ``run.steps`` (0: unbounded, also without a run section)."""
        return self.run.steps if self.run else 0


class Actor:
    """Base class. Subclasses set ``kind``, ``queues``, ``messages`` and override ``handle``."""

    kind: ClassVar[str] = ""
    queues: ClassVar[tuple[Queue, ...]] = ()  # what it consumes
    # work queues it publishes into: like its own queues, made by the supervisor before any actor starts
    # (`runtime.up`), as no actor role may create or change a stream (runtime.bus_auth)
    produces: ClassVar[tuple[Queue, ...]] = ()
    messages: ClassVar[tuple[type[Message], ...] | dict[str, type]] = ()  # what it accepts
    Config: ClassVar[type | None] = None  # frozen dataclass of this kind's config section
    bus_access: ClassVar[BusAccess] = BusAccess()  # what it says beyond every actor (runtime.bus_auth)
    # At most this many processes of the kind (``actors.<kind>.count``; None: any), and why: a kind
    # whose processes must not share its queue says so here, and a run file asking for more is refused.
    max_count: ClassVar[int | None] = None
    max_count_reason: ClassVar[str] = ""
    # A kind everything waits on (the reconciler): found unhealthy, by the supervisor, once no ping was answered for
    # ``actors.<kind>.lease_s`` (a frozen one is replaced within its lease), not only after failed checks in a row
    replaced_within_lease: ClassVar[bool] = False
    # Whether ``actors.<kind>.ranks`` > 1 is meaningful: its processes form one group (e.g. torch.distributed)
    supports_ranks: ClassVar[bool] = False

    @classmethod
    def provisioned_queues(cls) -> tuple[Queue, ...]:
        """The work queues (streams and durable consumers) the supervisor makes for this kind."""
        return tuple(dict.fromkeys(cls.queues + cls.produces))

    @classmethod
    def required_access(cls) -> BusAccess:
        """Everything this kind says on the bus beyond what every actor says: its queues and `bus_access`."""
        return cls.bus_access | BusAccess(streams=tuple((q.stream, q.durable) for q in cls.queues))

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self.identity = ctx.identity
        self.bus = ctx.bus
        self.settings = ctx.settings
        self.config = ctx.config
        self.codec = Codec(self.messages, blob=ctx.blob)
        self.state = ActorState.CREATED
        self.exit_stack = contextlib.AsyncExitStack()
        self._drain_requested = asyncio.Event()
        self._activated = asyncio.Event()
        # probes answered in tasks of their own: a control subscription hands over one request at a time, and a
        # probe of a wedged engine waits its whole timeout, so pings queued behind it went unanswered and a
        # process that was alive got a liveness verdict (killed, not drained as a readiness verdict has it)
        self._probes_in_flight: set[asyncio.Task[None]] = set()
        self._inflight = 0
        self._capacity = asyncio.Condition()
        self.num_handled = 0
        self.num_failed = 0
        self.num_dead_lettered = 0
        self.num_refused_senders = 0  # messages refused as not their subject's role's to send (why_refused)
        self.failure: str | None = None  # set by fail(): the run() that drains then raises ActorFailed
        self.num_rejected_config = 0  # live config values refused (see _apply_config)
        self._started_at = time.time()
        # the health checks' passive half reads it from every ping; its clock leaves out a full disk's wait
        self.work_timing = WorkTiming(paused_s=ctx.blob.space_waited_s if ctx.blob is not None else None)
        self._progress_at = self.work_timing.now()  # the last time a handling ended, or work was taken up idle
        self._log = log.bind(kind=self.identity.kind, actor=self.identity.actor_id)

    # --- hooks for subclasses ----------------------------------------------------------------
    async def setup(self) -> None:
        """Acquire resources (register them on ``self.exit_stack``)."""

    async def on_running(self) -> None:
        """What only an active process may do, once, just before it starts consuming: after `setup` for an actor
        started running, on activation for a warm spare (the reconciler takes the slot table over here, so a
        spare standing by never fences the reconciler it stands behind)."""

    async def handle(self, msg: Any, delivery: Delivery) -> None:
        raise NotImplementedError(f"{type(self).__name__} consumes {self.queues} but has no handle()")

    async def background(self, tg: asyncio.TaskGroup) -> None:
        """Start long-running loops in ``tg``; they are cancelled when the actor drains."""

    async def handover(self) -> dict[str, Any] | None:
        """State for the replacement process; kept in the ``actors`` bucket under handover.<kind>."""
        return None

    async def on_config_change(self, key: str, old: Any, new: Any) -> None:
        """Called after a live key of this kind's section changed; ``self.config`` is already new."""

    async def probe(self) -> None:
        """Can this actor do its job now? Raise with the reason if not (runtime.health asks it every so
        often: the rollout actor decodes a token, the reward actor runs a sandboxed command)."""

    def why_refused(self, msg: Any, subject: str) -> str | None:
        """Why ``msg`` is not believed as it arrived on ``subject`` (None: it is). The server's permissions
        bind each subject to the one role that may publish on it, so a message is believed only where its
        content speaks for that subject's role (a stage's completion on that stage's subject): a kind whose
        messages name whom they speak for checks it here; the base refuses, counts and dead-letters it."""
        return None

    @classmethod
    async def why_not_finished(cls, bus: Bus, blob: Any, run: Any, config: Any, request: dict[str, Any]) -> str | None:
        """Why a ``ctl.supervisor.finish`` from this kind is not believed (None: it is). Finishing ends the run for
        good, so a kind whose role may ask it (it declares the subject in `bus_access`) confirms the request
        against the durable state it speaks of (``blob``: the run's store, ``run``: its run section, ``config``:
        the run's application config, as its actors get it, or None); the supervisor asks this of every such
        kind. The base confirms nothing."""
        return f"actors of kind {cls.kind!r} do not say when the run has ended"

    def status(self) -> dict[str, Any]:
        return {}

    # --- lifecycle ----------------------------------------------------------------------------
    def _expect(self, *states: ActorState) -> None:
        if self.state not in states:
            raise LifecycleError(f"{self.identity.actor_id}: expected state "
                                 f"{'/'.join(s.value for s in states)}, but it is {self.state.value}")

    async def start(self) -> None:
        self._expect(ActorState.CREATED)
        self.state = ActorState.STARTING
        for q in self.queues:  # made by the supervisor: a missing one is said here, with the fix
            await self.bus.check_queue(q)
        await self.setup()
        await self._register()

    async def stand_by(self) -> None:
        """A warm spare: set up and registered as ``standby``, answering control requests, renewing its
        lease, consuming nothing, until ``ctl.<kind>.<id>.activate`` (the supervisor promotes it in place of an
        actor that died) or a drain request. ``run`` follows either way (a drained standby just stops)."""
        self._expect(ActorState.STARTING)
        self.state = ActorState.STANDBY
        # listening before the entry says standby: the health checks ping from then on (runtime.health)
        ctl = await self.bus.subscribe(control_subject(self.identity.kind, self.identity.actor_id), self._on_ctl)
        try:
            await self._register()
            self._log.info("actor_standing_by", pid=self.identity.pid, host=self.identity.host)
            async with asyncio.TaskGroup() as tg:
                lease = tg.create_task(self._renew_lease())
                await self._unless_drained(self._activated.wait())
                lease.cancel()
        finally:
            await self._unsubscribe_ctl(ctl)

    async def run(self) -> None:
        """Runs until a drain is requested (ctl drain, SIGTERM), then drains and stops."""
        self._expect(ActorState.STARTING, ActorState.STANDBY)
        if self.state is ActorState.STANDBY and not self._activated.is_set():  # drained as a spare
            await self._stop()
            return
        if self.state is ActorState.STANDBY:
            self._log.info("actor_activated", standby_s=round(time.time() - self._started_at, 3))
        # answering pings and keeping the lease before on_running, not after: a promoted spare reconciler takes the
        # slot table over there, which may take longer than its health bound, and it was killed as silent meanwhile
        ctl = await self.bus.subscribe(control_subject(self.identity.kind, self.identity.actor_id), self._on_ctl)
        async with asyncio.TaskGroup() as tg:
            lease = tg.create_task(self._renew_lease())
            config_watch: asyncio.Task[None] | None = None
            try:
                await self.on_running()
                config_watch = tg.create_task(self._watch_config())  # a live change meets an actor that is running
                async with asyncio.TaskGroup() as work_tg:
                    self.state = ActorState.RUNNING
                    await self._register()
                    self._log.info("actor_running", pid=self.identity.pid, host=self.identity.host,
                                   code_hash=self.identity.code_hash,
                                   queues=[q.name for q in self.queues])
                    loops = work_tg.create_task(self._run_background())
                    for q in self.queues:
                        work_tg.create_task(self._consume(q, work_tg))
                    await self._drain_requested.wait()
                    self.state = ActorState.DRAINING
                    self._log.info("actor_draining", num_inflight=self._inflight)
                    await self._stop_step("register_draining", self._register())
                    loops.cancel()
                # Leaving work_tg: consumers stopped fetching; every handler and its tasks finished.
            finally:
                if config_watch is not None:
                    config_watch.cancel()
                lease.cancel()
                await self._unsubscribe_ctl(ctl)
        await self._stop()
        if self.failure is not None:
            raise ActorFailed(self.failure)

    async def _run_background(self) -> None:
        async with asyncio.TaskGroup() as tg:
            await self.background(tg)

    def request_drain(self) -> None:
        self._drain_requested.set()

    async def _unless_drained(self, work: Coroutine[Any, Any, Any]) -> bool:
        """Awaits ``work`` unless a drain is requested first (``work`` is then cancelled); whether it finished.
        An exception of ``work`` propagates (in an ExceptionGroup)."""
        async with asyncio.TaskGroup() as tg:
            done = tg.create_task(work)
            drained = tg.create_task(self._drain_requested.wait())
            await asyncio.wait((done, drained), return_when=asyncio.FIRST_COMPLETED)
            finished = done.done()
            (drained if finished else done).cancel()
        return finished

    def fail(self, reason: str) -> None:
        """A fault this process cannot recover from (a dead engine, storage that keeps failing): stop
        taking work, let in-flight handlers end (they fail and nak, so the work is redelivered), then
        ``run`` raises `ActorFailed` and the process exits non-zero, for its supervisor to replace it."""
        if self.failure is None:
            self.failure = reason
            self._log.error("actor_failing", reason=reason)
        self.request_drain()

    async def _stop(self) -> None:
        state = await self.handover()
        if state is not None:
            await self._stop_step("save_handover", self._put_actors_key(
                handover_key(self.identity.kind), msgpack.packb(state, use_bin_type=True)))
        await self.exit_stack.aclose()
        self.state = ActorState.STOPPED
        self._log.info("actor_stopped", num_handled=self.num_handled, num_failed=self.num_failed,
                       num_dead_lettered=self.num_dead_lettered)
        # "stopped" before the entry goes: a reader knows it ended cleanly, not lost
        await self._stop_step("register_stopped", self._register())
        await self._stop_step("deregister", self._delete_actors_key(
            registration_key(self.identity.kind, self.identity.actor_id)))
        await self._stop_step("flush", self.bus.flush(timeout_s=self.settings.stop_step_timeout_s))

    async def _stop_step(self, step: str, call: Awaitable[Any]) -> bool:
        """One bus step of stopping, bounded: with the bus unreachable it is said (what was not done and
        why) and skipped, so that stopping is clean in every state; unacked work is redelivered anyway."""
        if self.bus.health.down.is_set():  # known down: no use waiting out the timeout step by step
            if asyncio.iscoroutine(call):
                call.close()
            self._log.error("stop_step_skipped", step=step, reason="the bus is down")
            return False
        try:
            async with asyncio.timeout(self.settings.stop_step_timeout_s):
                await call
        except OSError as e:  # BusError and TimeoutError are OSErrors
            self._log.error("stop_step_skipped", step=step, error=repr(e),
                            reason=f"the bus did not answer within {self.settings.stop_step_timeout_s}s")
            return False
        return True

    async def _put_actors_key(self, key: str, value: bytes) -> None:
        await self.bus.kv_put("actors", key, value)

    async def _delete_actors_key(self, key: str) -> None:
        await self.bus.kv_delete("actors", key)

    async def take_handover(self) -> dict[str, Any] | None:
        """The state a previous process of this kind handed over, consumed once (None: none was left).

        Raises:
            BusError: the bus could not be read; not the same as "nothing handed over".
        """
        key = handover_key(self.identity.kind)
        entry = await self.bus.kv_get("actors", key)
        if entry is None:
            return None
        await self.bus.kv_delete("actors", key)
        return msgpack.unpackb(entry.value, raw=False) if entry.value else None

    # --- consuming -----------------------------------------------------------------------------
    async def _consume(self, q: Queue, work_tg: asyncio.TaskGroup) -> None:
        sub = await self.bus.pull_consumer(q)
        try:
            while not self._drain_requested.is_set():
                async with self._capacity:
                    await self._capacity.wait_for(lambda: self._inflight < self.settings.max_concurrency)
                    free = self.settings.max_concurrency - self._inflight
                if self._drain_requested.is_set():
                    break
                msgs = await sub.fetch(free, timeout_s=self.settings.fetch_timeout_s)  # none in time: []
                for raw in msgs:
                    if self._inflight == 0:  # idle until now: the time without progress starts here
                        self._progress_at = self.work_timing.now()
                    self._inflight += 1
                    work_tg.create_task(self._process(q, raw))
        finally:
            await self._stop_step(f"unsubscribe_{q.name}", sub.unsubscribe())

    async def _process(self, q: Queue, raw: WorkMessage) -> None:
        """Decode, handle, settle. A message never loops: one that cannot decode is a dead letter at
        once; one whose handling failed ``max_deliveries`` times (or that came back that often
        unacknowledged: its handling crashed or hung the process) is a dead letter with its last error."""
        try:
            limit = self.settings.max_deliveries
            if raw.num_delivered > limit:
                await self._dead_letter(q, raw, "max_deliveries", (
                    f"delivered {raw.num_delivered} times (limit {limit}) without an acknowledgement: "
                    "its handling crashed or hung the actor's process each time (see the actor logs)"))
                return
            outages_before = self.bus.health.num_outages
            try:
                msg = await self.codec.decode(raw.data)
            except MessageError as e:
                await self._dead_letter(q, raw, e.reason, e.detail)
                return
            except Exception as e:  # the blob store is down: not the message's fault, retry it
                await self._failed(q, raw, "(undecoded)", e, outages_before)
                return
            if (why := self.why_refused(msg, raw.subject)) is not None:
                self.num_refused_senders += 1
                self._log.warning("message_refused", queue=q.name, subject=raw.subject, msg_type=type(msg).__name__,
                                  reason=why, num_refused=self.num_refused_senders)
                await self._dead_letter(q, raw, "wrong_subject", why)  # kept for the operator, never handled
                return
            try:
                with self.work_timing.handling():
                    async with asyncio.TaskGroup() as tg:
                        beat = tg.create_task(self._heartbeat(raw))
                        delivery = Delivery(q.name, raw.subject, raw.stream_sequence, raw.num_delivered, raw.msg_id,
                                            tg)
                        try:
                            await self.handle(msg, delivery)
                        finally:
                            beat.cancel()
            except Exception as e:  # a failing handler never kills the actor: nak and retry later
                if isinstance(dropped := _leaf(e), WorkDropped):
                    await self._dropped(q, raw, type(msg).__name__, dropped)
                else:
                    await self._failed(q, raw, type(msg).__name__, e, outages_before)
                return
            if await self._settle(raw, "ack"):
                self.num_handled += 1
        finally:
            self._progress_at = self.work_timing.now()
            async with self._capacity:
                self._inflight -= 1
                self._capacity.notify_all()

    async def _failed(self, q: Queue, raw: WorkMessage, msg_type: str, error: BaseException,
                      outages_before: int) -> None:
        """A handling failed: nak it with backoff, or dead-letter it once it used its deliveries. A failure
        while the bus dropped is the outage's, not the message's: it is nak'ed (up to the consumer's own
        max_deliver), so that an outage longer than the backoff does not dead-letter good work."""
        self.num_failed += 1
        num_delivered = raw.num_delivered
        error = _leaf(error)
        health = self.bus.health
        during_outage = health.num_outages != outages_before or health.down.is_set()
        limit = self.settings.max_deliveries if not during_outage else self.bus.limits.max_deliver - 1
        if num_delivered >= limit:
            await self._dead_letter(q, raw, "max_deliveries", (
                f"{msg_type} failed {num_delivered} deliveries (limit {limit}); last error: {error!r}"))
            return
        delay = self.settings.nak_delay(num_delivered)
        self._log.warning("handler_failed", queue=q.name, msg_type=msg_type, error=repr(error),
                          num_delivered=num_delivered, retry_in_s=delay, during_bus_outage=during_outage)
        await self._settle(raw, "nak", delay=delay)

    async def _dropped(self, q: Queue, raw: WorkMessage, msg_type: str, why: WorkDropped) -> None:
        """Work the run no longer wants (`WorkDropped`: expected, e.g. at the end of a run): acked at once, not
        retried until it is dead-lettered as an error, since nothing about it is wrong; whoever ordered it keeps
        its own record of it."""
        self._log.info("work_dropped", queue=q.name, msg_type=msg_type, reason=str(why), subject=raw.subject,
                       num_delivered=raw.num_delivered)
        await self._settle(raw, "ack")

    async def _settle(self, raw: WorkMessage, verb: str, **kwargs: Any) -> bool:
        """Ack or nak; with the bus down the server redelivers after ``ack_wait`` (at-least-once), so a
        failed settlement is said and the actor goes on instead of crashing on an outage."""
        try:
            await getattr(raw, verb)(**kwargs)
        except OSError as e:  # BusError included
            self._log.warning("settle_failed", verb=verb, subject=raw.subject, error=repr(e))
            return False
        return True

    async def _heartbeat(self, raw: WorkMessage) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await raw.in_progress()

    async def _dead_letter(self, q: Queue, raw: WorkMessage, reason: str, detail: str) -> None:
        try:
            await self.bus.dead_letter(q.name, reason, detail, raw.data, subject=raw.subject,
                                       actor=self.identity.actor_id,
                                       num_delivered=raw.num_delivered)
        except OSError as e:  # BusError included; not stored: leave it for redelivery, never lose it
            self._log.warning("dead_letter_failed", queue=q.name, reason=reason, error=repr(e))
            return
        self.num_dead_lettered += 1
        self._log.error("message_dead_lettered", queue=q.name, reason=reason, detail=detail,
                        subject=raw.subject, size=len(raw.data))
        await self._settle(raw, "ack")  # never redeliver what can never be handled

    # --- control -------------------------------------------------------------------------------
    async def _on_ctl(self, raw: Inbound) -> None:
        verb = raw.subject.rsplit(".", 1)[-1]
        if verb == "ping":
            reply = self.ping()
        elif verb == "probe":
            task = asyncio.create_task(self._answer_probe(raw))
            self._probes_in_flight.add(task)
            task.add_done_callback(self._probes_in_flight.discard)
            return
        elif verb == "status":
            reply = self.describe()
        elif verb == "drain":
            self.request_drain()
            reply = {"ok": True, "state": ActorState.DRAINING.value}
        elif verb == "activate":
            ok = self.state is ActorState.STANDBY and not self._drain_requested.is_set()
            if ok:
                self._activated.set()
            reply = {"ok": ok, "state": self.state.value} if ok else {
                "ok": False, "error": f"not a standby that can be activated (state {self.state.value})"}
        elif verb == "metrics":
            reply = {"ok": True, "text": actor_metrics.exposition(self).decode()}
        else:
            reply = {"ok": False,
                     "error": f"unknown verb {verb!r}; use ping, probe, status, metrics, activate or drain"}
        await self.bus.respond(raw, msgpack.packb(reply, use_bin_type=True))

    def ping(self) -> dict[str, Any]:
        """The answer to ``ctl.<kind>.<id>.ping``: alive, and what the health checks' passive half reads
        (runtime.health): outcomes so far, and the handlings' times (on the work clock: runtime.work_timing)."""
        return {"ok": True, "state": self.state.value, "busy_without_progress_s": self.busy_without_progress_s,
                "num_handled": self.num_handled, "num_failed": self.num_failed,
                "oldest_in_hand_s": self.work_timing.oldest_in_hand_s(),
                "recent_handling_p99_s": self.work_timing.recent_quantile(0.99),
                "num_recent_handlings": self.work_timing.num_recent}

    async def _answer_probe(self, raw: Inbound) -> None:
        reply = await self._probe()
        try:
            await self.bus.respond(raw, msgpack.packb(reply, use_bin_type=True))
        except OSError as e:  # BusError included: the asker takes the silence for a failed probe
            self._log.warning("probe_answer_failed", error=repr(e))

    async def _unsubscribe_ctl(self, ctl: Any) -> None:
        """Stops answering control requests: unsubscribes, and cancels the probes still being answered."""
        for task in list(self._probes_in_flight):
            task.cancel()
        await asyncio.gather(*self._probes_in_flight, return_exceptions=True)
        await self._stop_step("unsubscribe_ctl", ctl.unsubscribe())

    async def _probe(self) -> dict[str, Any]:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self.probe()
        except Exception as e:  # any failure of the probe is the answer: not ready, and why
            self._log.warning("probe_failed", error=repr(e))
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True}

    @property
    def busy_without_progress_s(self) -> float:
        """Seconds this actor has held work without finishing any handling (0 when it holds none), on the work
        clock (a full disk's wait is not counted: runtime.work_timing)."""
        return round(self.work_timing.now() - self._progress_at, 3) if self._inflight else 0.0

    # what runtime.actor_metrics reads at a scrape
    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def uptime_s(self) -> float:
        return time.time() - self._started_at

    @property
    def state_name(self) -> str:
        return self.state.value

    @property
    def kind_name(self) -> str:
        return self.identity.kind

    def describe(self) -> dict[str, Any]:
        i = self.identity
        return {"kind": i.kind, "id": i.actor_id, "pid": i.pid, "host": i.host, "code_hash": i.code_hash,
                "state": self.state.value, "failure": self.failure,
                "num_inflight": self._inflight, "num_handled": self.num_handled,
                "num_failed": self.num_failed, "num_dead_lettered": self.num_dead_lettered,
                "num_refused_senders": self.num_refused_senders, "num_rejected_config": self.num_rejected_config,
                "uptime_s": round(time.time() - self._started_at, 3), "lease_s": self.settings.lease_s,
                **self.status()}

    async def _renew_lease(self) -> None:
        """The registry entry is a lease: renewed (with fresh counters) every third of ``lease_s``."""
        while True:
            await asyncio.sleep(self.settings.lease_s / 3)
            try:
                await self._register()
            except OSError as e:  # BusError, TimeoutError: the bus is away, the lease lapses, as it should
                self._log.warning("lease_renewal_failed", error=repr(e))

    async def _register(self) -> None:
        # with the lease as its TTL: the server itself removes the entry of an actor that stops renewing it
        await self.bus.kv_put("actors", registration_key(self.identity.kind, self.identity.actor_id),
                              msgpack.packb(self.describe(), use_bin_type=True), ttl_s=self.settings.lease_s)

    # --- live configuration -------------------------------------------------------------------------
    async def _watch_config(self) -> None:
        if self.Config is None or self.config is None:
            return
        async for entry in self.bus.kv_watch("config"):  # renewed across bus outages
            if entry is None or entry.deleted or not entry.value:
                continue
            await self._apply_config(entry.key, entry.value)

    async def _apply_config(self, key: str, raw: bytes) -> None:
        full_key = key
        try:
            value = msgpack.unpackb(raw, raw=False)
            if not config_mod.is_live(type(self.config), key):
                raise ConfigError(f"config key {full_key!r} is not live; restart the run to change it")
            old = self.config
            new = config_mod.apply_value(old, key, value)
        except (ConfigError, ValueError) as e:
            self.num_rejected_config += 1
            self._log.error("config_change_rejected", key=full_key, error=str(e))
            return
        old_value = _get_path(old, key)
        if old_value == _get_path(new, key):
            return
        self.config = new
        try:  # the kind's own check of the new value against its state (e.g. a batch must still form)
            await self.on_config_change(key, old_value, _get_path(new, key))
        except (ConfigError, ValueError) as e:
            self.config = old
            self.num_rejected_config += 1
            self._log.error("config_change_rejected", key=full_key, error=str(e))
            return
        self._log.info("config_changed", key=full_key, old=old_value, new=_get_path(new, key))


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _leaf(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e

