"""The reconciler actor: owns the slot table and moves every sample through its lifecycle.

It wraps the transport-free core (actors.reconciler.lifecycle.Lifecycle) with NATS: completions arrive on
``done.<stage>`` (a durable stream, acked only after the core has recorded them), work orders go out
on ``work.<stage>`` with the order's (stage, key, attempt) as the message id, stage actors' liveness
arrives on ``heartbeat.<stage>``, the live rollout-actor count comes from the actor registry, and a
tick re-checks timeouts and admission. Registry entries are leases (`actors.reconciler.registry_view`): an
actor whose lease runs out, or whose entry is removed while it was not stopped, is lost, and the
work it was last seen on is re-issued at once (``on_actor_lost``), not after its stage's timeout.
Each weights announcement moves the core's trainer version (``on_trainer_version``). The table lives
in the ``slots`` KV bucket, every write a compare-and-set, so a restarted reconciler (or a resumed
run) continues where this one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any, ClassVar

import msgpack
import structlog

from actors.blob_collector import BlobCollector
from actors.config import RLConfig
from actors.messages import (
    COMPLETION_TYPES,
    DONE_QUEUE,
    RECONCILER_KIND,
    DataExhausted,
    WeightsPublished,
    WorkHeartbeat,
    WorkHeartbeats,
    all_order_types,
    data_exhausted_subject,
    why_beat_not_from_subject,
    why_not_from_subject,
    work_queue_of,
)
from actors.reconciler.fence import Fenced, TableClaim, check_claim, take_table
from actors.reconciler.kv_store import KVSlotStore, PipelinedKVSlotStore, StoreBroken
from actors.reconciler.lifecycle import CoreBroken, Lifecycle, LifecycleConfig
from actors.reconciler.registry_view import LostActor, RegistryView
from actors.reconciler.slot import Stage
from actors.reconciler.store import CasConflict
from actors.reconciler.work import RewardGroupDone, RolloutGroupDone, WorkOrder, group_orders
from actors.task_catalog import TaskCatalog
from actors.weights_announcements import weights_run_name, weights_subject, why_not_published
from runtime import config as config_mod
from runtime.actor import Actor, Delivery
from runtime.bus_auth import BusAccess
from runtime.codec import Codec
from runtime.registry import (
    actor_kind,
    decode_registration,
    is_registration_key,
    parse_registration_key,
    registration_key,
)

log = structlog.get_logger(__name__)

__all__ = ["ReconcilerActor"]


class ReconcilerActor(Actor):
    kind = RECONCILER_KIND
    queues = (DONE_QUEUE,)
    produces = tuple(work_queue_of(s) for s in Stage)
    messages = COMPLETION_TYPES
    Config = RLConfig
    # every sample waits on it: one at a time (a second one fences the first off the table), and a frozen one is
    # replaced within its lease (actors.reconciler.lease_s)
    max_count: ClassVar[int | None] = 1
    max_count_reason: ClassVar[str] = "the slot table has one writer: a second reconciler takes it over (fencing)"
    replaced_within_lease: ClassVar[bool] = True
    pipelined_writes: ClassVar[bool] = True  # group commit (see _call); False: one round trip per write
    # the only one to issue work, write the slot table and say the data ran out
    # and it follows weights announcements (the trainer's version)
    bus_access = BusAccess(publish=("work.*", "data_exhausted.*"), subscribe=("heartbeat.>", "weights.*"),
                           kv_write=("slots",), kv_keys=(("actors", "reg.>"),))  # deletes lost actors' leases

    async def setup(self) -> None:
        self.source = TaskCatalog.build(self.config.tasks)
        self.order_codec = Codec(all_order_types())
        self.heartbeat_codec = Codec([WorkHeartbeat, WorkHeartbeats])
        self.exhausted_codec = Codec([DataExhausted])
        self.run_name = weights_run_name(self.ctx)
        self.announced_exhausted = False
        self._warn_if_steps_exceed_data()
        self.core_lock = asyncio.Lock()  # the core is called from one task at a time
        self.num_rejected_registrations = 0
        self.num_rejected_announcements = 0
        self.num_refused_heartbeats = 0  # heartbeats of one stage on another stage's subject
        # its own lease says whether the registry is live; no entry is believed past the run's longest lease
        self.registry = RegistryView(witness=self.identity.actor_id,
                                     lease_bound_s=await self.bus.kv_max_age_s("actors"))
        self.num_rollout_actors = await self._count_rollout_actors()
        r = self.config.reconciler
        self.blobs = BlobCollector(self.ctx.blob, group_size=r.group_size, retention_versions=r.blob_retention_versions,
                                   is_live=lambda group_id: self.core.is_live_group(group_id))
        self.orders_out = await self.bus.confirming_publisher()
        self.exit_stack.push_async_callback(self.orders_out.close)
        self.num_fenced = 0
        self.claim: TableClaim | None = None  # the table is taken over when this one starts consuming
        self._claim_held_at = float("-inf")  # time.monotonic() when the fence last showed the claim held
        self.weights_codec = Codec([WeightsPublished])

    async def on_running(self) -> None:
        # before reading the table: whoever held it (a frozen predecessor that may wake) can write no more
        try:
            self.claim = await take_table(self.bus, "slots", self.identity.actor_id)
        except Fenced as e:  # taken over while its own takeover went unanswered (frozen with it in flight)
            self._be_fenced(str(e), epoch=None)
            raise
        log.info("reconciler_took_table", epoch=self.claim.epoch, previous_holder=self.claim.previous_holder)
        try:
            await self._resume()
        except (OSError, CasConflict):  # frozen during its takeover and woken: its request in flight timed out, or
            await self._hold_table()  # its writes were refused; another that took the table meanwhile makes it
            raise  # fenced (said so), not a fault
        sub = await self.bus.subscribe("heartbeat.>", self._on_heartbeat)
        self.exit_stack.push_async_callback(sub.unsubscribe)
        sub = await self.bus.subscribe(weights_subject(self.run_name), self._on_weights)
        self.exit_stack.push_async_callback(sub.unsubscribe)

    def _warn_if_steps_exceed_data(self) -> None:
        r, steps = self.config.reconciler, self.ctx.run_steps
        if not steps:
            return
        num_batches = -(-len(self.source) * r.num_epochs // r.batch_size_groups)  # at most, with no group dropped
        if steps > num_batches:
            log.warning("run_steps_exceed_dataset", steps=steps, max_versions=num_batches,
                        num_prompts=len(self.source), num_epochs=r.num_epochs,
                        fix="the run ends at the dataset's last version; raise reconciler.num_epochs for more")

    def _lifecycle_config(self) -> LifecycleConfig:
        r = self.config.reconciler
        return LifecycleConfig(
            num_slots=r.num_slots,
            group_size=r.group_size,
            batch_size_groups=r.batch_size_groups,
            num_epochs=r.num_epochs,
            scheduling=r.scheduling,
        )

    async def _open_store(self) -> KVSlotStore:
        if self.pipelined_writes:
            return await PipelinedKVSlotStore.open(self.bus, "slots")
        return KVSlotStore(self.bus, "slots")

    async def _hold_table(self) -> None:
        """Returns while this reconciler still holds the table; else it is fenced: it fails (drains, writes
        nothing more, exits non-zero) and `Fenced` is raised to whatever it was about to do."""
        assert self.claim is not None, "the table is taken over before it is read (on_running)"
        try:
            await check_claim(self.bus, "slots", self.claim)
        except Fenced as e:
            self._be_fenced(str(e), epoch=self.claim.epoch)
            raise
        self._claim_held_at = time.monotonic()

    def _be_fenced(self, reason: str, epoch: int | None) -> None:
        """Says it (``epoch``: the one it held, None if its takeover never came back) and fails: drains, exits."""
        self.num_fenced += 1
        log.error("reconciler_fenced", epoch=epoch, reason=reason,
                  fix="nothing to do: the reconciler that took the table over carries on")
        self.fail(reason)

    async def _may_answer(self) -> bool:
        """Whether this reconciler may still answer from its view of the table: not failed (fenced included), and
        its claim seen held within half its lease or read again now. A running one learns of a takeover within a
        tick (`_tick_loop` reads the fence each tick, far more often: nothing more is read here). A frozen one is
        replaced only after going unanswered for its lease, and the monotonic clock counts the freeze, so one that
        wakes reads the fence before it says anything instead of answering from its stale view until its next tick.
        What it publishes needs no such check: its orders go out only after the writes that decided them landed,
        each chained on the claim's sequence, and ``data_exhausted`` and lease removals follow the tick's read."""
        if self.failure is not None or self.claim is None:
            return False
        if time.monotonic() - self._claim_held_at <= self.settings.lease_s / 2:
            return True
        try:
            await self._hold_table()
        except Fenced:
            return False
        except OSError as e:  # BusError included: the claim unconfirmed, so nothing is said on it
            log.warning("reconciler_fence_unread", error=repr(e))
            return False
        return True

    async def _resume(self) -> None:
        old = getattr(self, "store", None)
        if isinstance(old, PipelinedKVSlotStore):
            await old.close()
        # A fresh store (a pipelined one that failed stays broken). Its first write is conditioned on the bucket's
        # last sequence as read when it opens, so the claim is confirmed only after that read: a takeover before
        # it is seen here (fenced), one after it refuses that first write. Checked the other way round, a
        # reconciler frozen between the check and the opening, woken after a takeover, opened on the successor's
        # sequence and its first write landed. A refused write is most likely a successor's takeover: never
        # rebuild over it.
        self.store = await self._open_store()
        await self._hold_table()
        resumed = await Lifecycle.resume(
            self.store, self.source, self._lifecycle_config(), time.time(), num_rollout_actors=self.num_rollout_actors
        )
        await self.store.sync()  # the rebuilt table is durable before a re-issued order goes out
        self.core = resumed.lifecycle
        log.info(
            "reconciler_resumed",
            trainer_version=self.core.trainer_version,
            num_reissued=resumed.num_reissued,
            num_adopted=resumed.num_adopted,
            num_rolled_back_slots=resumed.num_rolled_back_slots,
            num_discarded_groups=resumed.num_discarded_groups,
            num_orders=len(resumed.orders),
        )
        await self._issue(resumed.orders)

    async def _call(self, method: str, *args: Any) -> bool:
        """Calls one core event method and publishes the orders it returns; a broken core is rebuilt.

        Group commit: with a pipelined store the core's writes go out without waiting for their
        acknowledgements, the lock is released, and this call then waits (`sync`) until its writes
        and every earlier one are durable; only then are its orders published and (for a
        completion) the message acknowledged by the base. Meanwhile the next events already run
        through the core, so one round trip covers many transitions. If a write failed, the core
        no longer matches the store: it is dropped and a new one resumed from the store, and the
        call raises (a completion is then nak'ed, redelivered and judged by the new core). Returns
        False if the core was broken and rebuilt: the event was not recorded.
        """
        async with self.core_lock:
            core, store = self.core, self.store
            try:
                orders = await getattr(core, method)(*args, time.time())
            except CoreBroken as e:
                log.error("reconciler_core_broken", error=str(e))
                await self._resume()
                return False
        try:
            await store.sync()
        except Exception as e:
            await self._discard(core, e)
            raise
        await self._issue(orders)
        self._retire_finished_groups()
        return True

    def _retire_finished_groups(self) -> None:
        """Groups that left the table (trained or dropped, durably: the call synced) go to the blob collector:
        the core says which (no walk over the table's slots per group that leaves)."""
        left = self.core.take_left_groups()
        if not left:
            return
        self.blobs.retire(left, self.core.trainer_version)
        self.blobs.advance(self.core.trainer_version)

    async def _discard(self, core: Lifecycle, error: Exception) -> None:
        async with self.core_lock:
            if self.core is core:
                log.error("reconciler_store_write_failed", error=repr(error))
                await self._resume()

    async def _issue(self, orders: list[WorkOrder] | tuple[WorkOrder, ...]) -> None:
        """Publishes the orders into their work streams without waiting for acknowledgements.

        The decision each order carries is already durable (`_call` synced the table first). The
        acknowledgements are checked behind the reconciler's back (`ConfirmingPublisher`): an order the
        stream did not store (a cluster electing the stream's leader) is published again under its message
        id within seconds, instead of waiting for its stage's timeout. So the reconciler pays neither a
        reply nor a round trip per order, and loses none.
        """
        for order in group_orders(list(orders)):  # a group's rollout (reward) orders in one message
            data = await self.order_codec.encode(order)
            await self.orders_out.publish(f"work.{order.STAGE.value}", data, msg_id=order.msg_id)

    # --- inputs -------------------------------------------------------------------------------
    def why_refused(self, msg: Any, subject: str) -> str | None:
        return why_not_from_subject(msg, subject)  # a stage's completion, only on that stage's done subject

    async def handle(self, msg: Any, delivery: Delivery) -> None:
        # Acked by the base only after the core recorded it; a broken core did not: nak, redeliver.
        call = ("on_completions", msg.events) if isinstance(msg, RolloutGroupDone | RewardGroupDone) else (
            "on_completion", msg)
        if not await self._call(*call):
            raise RuntimeError("the reconciler's core broke while recording this completion (rebuilt from the "
                               "store); it is nak'ed and the rebuilt core judges its redelivery")

    async def _on_heartbeat(self, raw: Any) -> None:
        # a fenced (or failed) one says nothing: its "still wanted" would have a stage actor redo an attempt the
        # successor re-issued; unanswered, the asker waits for the reconciler that holds the table
        if not await self._may_answer():
            return
        try:
            msg = await self.heartbeat_codec.decode(raw.data)
        except ValueError as e:
            log.warning("heartbeat_rejected", error=str(e))
            return
        beats = msg.beats if isinstance(msg, WorkHeartbeats) else (msg,)  # a group order's items beat together
        if (why := next(filter(None, (why_beat_not_from_subject(b, raw.subject) for b in beats)), None)) is not None:
            self.num_refused_heartbeats += 1  # a role keeping another stage's work alive: believed for none of it
            log.warning("heartbeat_refused", subject=raw.subject, reason=why, num_refused=self.num_refused_heartbeats)
            return  # unanswered: the asker is no stage actor of that stage
        now = time.time()
        for beat in beats:
            self.core.on_heartbeat(beat.stage, beat.key, beat.attempt, beat.actor_id, now, beat.token)
        if raw.reply:  # a stage actor asks before it starts: is this attempt (each of these items) still wanted?
            items = [self.core.is_current(b.stage, b.key, b.attempt) for b in beats]
            # answered into the inbox of the kind the beat names, and only if they all name one
            requesters = {actor_kind(b.actor_id) for b in beats}
            await self.bus.respond(raw, msgpack.packb({"current": any(items), "current_items": items},
                                                      use_bin_type=True),
                                   requester=requesters.pop() if len(requesters) == 1 else "")

    async def _on_weights(self, raw: Any) -> None:
        try:
            msg = await self.weights_codec.decode(raw.data)
        except ValueError as e:
            log.warning("weights_announcement_rejected", error=str(e))
            return
        why_not = await why_not_published(msg, run=self.run_name, store=self.ctx.blob)
        if why_not is not None:  # a forged or stale announcement must not move the trainer's version
            self.num_rejected_announcements += 1
            log.warning("weights_announcement_rejected", version=msg.version, reason=why_not)
            return
        try:
            await self._call("on_trainer_version", msg.version)
        except Exception as e:  # the store failed: _call rebuilt the core; the next TrainDone carries the version
            log.error("trainer_version_not_recorded", version=msg.version, error=repr(e))

    async def on_config_change(self, key: str, old: Any, new: Any) -> None:
        if key.startswith("reconciler.scheduling."):
            await self._call("update_scheduling", self.config.reconciler.scheduling)

    async def background(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.orders_out.run())
        tg.create_task(self._until_fenced(self._tick_loop()))
        tg.create_task(self._until_fenced(self._watch_rollout_actors()))
        if self.ctx.blob is not None:
            tg.create_task(self.blobs.run())
            tg.create_task(self.blobs.sweep(self.core.trainer_version))

    async def _until_fenced(self, loop: Coroutine[Any, Any, None]) -> None:
        """Runs one of the reconciler's loops until it is fenced (`_hold_table`: it is then draining)."""
        with contextlib.suppress(Fenced):
            await loop

    async def _tick_loop(self) -> None:
        while True:
            try:  # a takeover is learnt within a tick, written or not: one woken from a freeze must not answer
                await self._hold_table()  # the stage actors' "still wanted?" from its old view either
            except OSError as e:  # BusError included: unread, nothing decided on it; read again next tick
                log.warning("reconciler_fence_unread", error=repr(e))
                await asyncio.sleep(self.config.reconciler.tick_s)
                continue
            try:
                await self._call("tick")
            except StoreBroken as e:  # a write not stored (the bus away, a cluster electing a leader): the core
                log.warning("reconciler_tick_not_recorded", error=str(e))  # was rebuilt from the store; next tick
            for lost in self.registry.expire(time.monotonic()):  # the table held as of this tick (above)
                await self._lose(lost)
                # ops.status must not show it running; a frozen actor that comes back registers again
                await self.bus.kv_delete("actors", registration_key(lost.kind, lost.actor_id))
            await self._count_rollouts_from_registry()
            if self.core.is_finished:
                await self._say_data_exhausted()
            await asyncio.sleep(self.config.reconciler.tick_s)

    async def _say_data_exhausted(self) -> None:
        """The dataset's last epoch is done: no version after the trainer's current one will come, so
        whoever ends the run (the evaluator, after its final evaluation) must not wait for ``run.steps``."""
        version = self.core.trainer_version
        if not self.announced_exhausted:
            log.info("dataset_exhausted", last_version=version, steps=self.ctx.run_steps)
            self.announced_exhausted = True
        data = await self.exhausted_codec.encode(DataExhausted(self.run_name, version))
        await self.bus.publish(data_exhausted_subject(self.run_name), data)

    async def _count_rollout_actors(self) -> int:
        """Running rollout actors in the registry now, read into `registry` (the count the watch keeps after)."""
        now = time.monotonic()
        for entry in await self.bus.kv_items("actors"):  # one bulk read, not a request per actor
            registered = parse_registration_key(entry.key)
            if registered is None or self._registration(entry.key, entry.value) is None:
                continue  # a handover record, a forgery
            self.registry.observe(registered[1], entry.value, now)
        return self.registry.num_running("rollout")

    async def _watch_rollout_actors(self) -> None:
        """Follows the registry's entries (no requests per event: each would be a round trip and a
        place where Python 3.11's ``wait_for`` can swallow the drain's cancellation): live rollout
        actors, and actors lost (their leases are also checked on every tick)."""
        async for entry in self.bus.kv_watch("actors"):  # renewed (current values replayed) after an outage
            if entry is None or not is_registration_key(entry.key):  # end of the initial values; a handover
                continue
            value = entry.value if not entry.deleted and entry.value else None
            if value is not None and self._registration(entry.key, value) is None:
                continue  # not an actor's own complete entry (a forgery): follows nothing
            if (registered := parse_registration_key(entry.key)) is None:
                continue  # the removal of a key no actor's lease is under: follows nothing
            lost = self.registry.observe(registered[1], value, time.monotonic(), expired=entry.purged)
            if lost is not None:
                await self._lose(lost)
            await self._count_rollouts_from_registry()

    async def _count_rollouts_from_registry(self) -> None:
        count = self.registry.num_running("rollout")
        if count != self.num_rollout_actors:
            self.num_rollout_actors = count
            log.info("rollout_actors_changed", num_rollout_actors=count)
            await self._call("set_rollout_actors", count)

    async def _lose(self, lost: LostActor) -> None:
        """Re-issue at once what a lost actor was last seen working on (its heartbeats named it)."""
        log.warning("actor_lost", actor_id=lost.actor_id, actor_kind=lost.kind, reason=lost.reason)
        await self._call("on_actor_lost", lost.actor_id)

    def _registration(self, key: str, raw: bytes) -> dict[str, Any] | None:
        """The complete registry entry stored under `key`; anything else is None (a refused one counted)."""
        if not is_registration_key(key):
            return None
        try:
            return decode_registration(key, raw)
        except ValueError as e:
            self.num_rejected_registrations += 1
            log.warning("registry_entry_rejected", key=key, reason=str(e),
                        num_rejected=self.num_rejected_registrations)
            return None

    @property
    def _holds_a_core(self) -> bool:
        """Whether the table is taken over and its core built from it. The claim alone is a takeover in progress
        (``on_running``: its lease is renewed meanwhile, with this status), or one frozen there and woken fenced:
        its status read the core not yet built and crashed the process, where it is to be fenced and exit."""
        return self.claim is not None and hasattr(self, "core")

    async def handover(self) -> dict[str, Any] | None:
        """Nothing to hand over (the table is durable in KV); log the final accounting instead."""
        if not self._holds_a_core:  # a spare that never held the table, or one stopped while taking it over
            return None
        snapshot = self.core.snapshot(time.time())
        live_groups = sorted({s.group_id for s in self.core.slots if s.is_live})
        log.info(
            "reconciler_accounting",
            cursor_epoch=snapshot.cursor_epoch,
            cursor_position=snapshot.cursor_position,
            trainer_version=self.core.trainer_version,
            live_groups=live_groups,
            counters=dict(snapshot.counters),
            slots_per_state=dict(snapshot.slots_per_state),
        )
        return None

    def status(self) -> dict[str, Any]:
        if not self._holds_a_core:  # standing by (or starting, or taking the table over): no table of its own yet
            return {"num_fenced": self.num_fenced}
        snapshot = self.core.snapshot(time.time())
        return {
            "lifecycle": snapshot.to_dict(),
            "trainer_version": self.core.trainer_version,
            "finished": self.core.is_finished,
            "scheduling": config_mod.to_dict(self.core.scheduling),
            "num_rejected_registrations": self.num_rejected_registrations,
            "num_rejected_announcements": self.num_rejected_announcements,
            "num_refused_heartbeats": self.num_refused_heartbeats,
            "table_epoch": self.claim.epoch,  # one more on each takeover of the slot table (fencing)
            "num_fenced": self.num_fenced,
            "num_orders_published": self.orders_out.num_published,
            "num_orders_published_again": self.orders_out.num_republished,  # not stored in time: sent again
            "orders_unconfirmed": self.orders_out.num_unconfirmed,
            "num_orders_abandoned": self.orders_out.num_abandoned,  # never stored: left to the stage timeouts
        }


