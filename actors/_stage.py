"""What every stage actor (rollout, reward, grouping, trainer) shares: take an order, do the work while
telling the reconciler it is alive, report the completion (or the failure) on ``done.<stage>``.

Completions carry the order's issuance token and are published durably with a message id of (stage,
key, attempt, token), so a redelivered order that is handled again reports the same completion and the
stream deduplicates it, and nobody who has not seen the order can pre-empt that id.

A group order (`RolloutGroupOrder`, `RewardGroupOrder`: one message for a group's samples) is split here
into one ``work`` call per item, at most ``max_concurrency`` items at a time across the actor, and their
results gathered into one group completion, so a stage actor only ever sees single orders. Each item
keeps its own semantics: a refusal (`WorkRefused`) is that item's `StageFailed` (a counted retry of that
sample alone); a plain failure of any item fails the message as a single order's would (nak, redelivered
with the same attempts, every item done again: its results are keyed by attempt, so that is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, ClassVar, TypeVar

import msgpack
import structlog
import zstandard

from actors.config import RLConfig
from actors.messages import (
    COMPLETION_TYPES,
    RECONCILER_KIND,
    WorkHeartbeat,
    WorkHeartbeats,
    done_subject,
    heartbeat_subject,
    order_types,
    work_queue_of,
)
from actors.reconciler.slot import Stage
from actors.reconciler.work import RewardGroupOrder, RolloutGroupOrder, StageFailed, bound_to, group_done
from actors.records import RecordError, decode_record, encode_record
from runtime.actor import Actor, ActorContext, Delivery
from runtime.bus_auth import BusAccess
from runtime.codec import Codec
from runtime.errors import BusTimeout, NoResponders
from runtime.registry import registration_key
from sandbox.latency import LatencyModel

log = structlog.get_logger(__name__)

R = TypeVar("R")


class OrderGoesBack(RuntimeError):
    """The order is not started here after all (the actor drains): nak'ed, and redelivered to another."""


class WorkRefused(ValueError):
    """The order cannot be done by anyone (bad input, broken staleness bound): report it, do not retry."""


class StageActor(Actor):
    """Subclasses set ``stage`` and implement ``work(order) -> completion``."""

    stage: ClassVar[Stage]
    Config = RLConfig
    heartbeat_every_s: ClassVar[float] = 5.0
    still_wanted_timeout_s: ClassVar[float] = 2.0  # one ask of `_ask_still_wanted`
    still_wanted_patience_s: ClassVar[float] = 30.0  # all its asks, before a redelivered order is done unasked

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "stage" in cls.__dict__:
            cls.kind = cls.kind or cls.stage.value
            cls.queues = (work_queue_of(cls.stage),)
            cls.messages = order_types(cls.stage)
            # its completions and heartbeats, and nothing of another stage's
            cls.bus_access = cls.bus_access | BusAccess(publish=(done_subject(cls.stage),
                                                                 heartbeat_subject(cls.stage)))

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.config: RLConfig
        self.done_codec = Codec(COMPLETION_TYPES)
        self.heartbeat_codec = Codec([WorkHeartbeat, WorkHeartbeats])
        self._item_slots = asyncio.Semaphore(self.settings.max_concurrency)  # items of group orders at once

    async def work(self, order: Any, delivery: Delivery) -> Any:
        """Do the order; tasks it starts in ``delivery.task_group`` finish before the order is acked."""
        raise NotImplementedError

    async def handle(self, msg: Any, delivery: Delivery) -> None:
        if isinstance(msg, RolloutGroupOrder | RewardGroupOrder):
            await self._handle_group(msg, delivery)
            return
        # Only a redelivery can be an attempt the table has since superseded (its actor was lost and the work
        # re-issued): a first delivery starts without the round trip; a stale completion is ignored anyway.
        if delivery.num_delivered > 1 and not await self._still_wanted(msg):  # acked by the base
            log.info("superseded_order_skipped", stage=self.stage.value, key=msg.key, attempt=msg.attempt,
                     num_delivered=delivery.num_delivered)
            return
        beat = delivery.task_group.create_task(self._report_alive(msg))
        try:
            done = await self.work(msg, delivery)
        except WorkRefused as e:
            log.warning("work_refused", stage=self.stage.value, key=msg.key, attempt=msg.attempt, reason=str(e))
            done = StageFailed(self.stage, msg.key, msg.attempt, str(e))
        finally:
            beat.cancel()
        done = bound_to(done, msg)
        await self.bus.publish_durable(done_subject(self.stage), await self.done_codec.encode(done),
                                       msg_id=f"done.{self.stage.value}.{msg.key}.{msg.attempt}.{msg.token}")

    async def _handle_group(self, order: RolloutGroupOrder | RewardGroupOrder, delivery: Delivery) -> None:
        items = order.items
        if delivery.num_delivered > 1:  # as for a single order, per item: skip the superseded ones
            wanted = await self._wanted_items(order)
            for item, is_wanted in zip(order.items, wanted, strict=True):
                if not is_wanted:
                    log.info("superseded_order_skipped", stage=self.stage.value, key=item.key, attempt=item.attempt,
                             num_delivered=delivery.num_delivered)
            items = tuple(item for item, is_wanted in zip(order.items, wanted, strict=True) if is_wanted)
            if not items:
                return  # acked by the base
        beat = delivery.task_group.create_task(self._report_alive(order))
        try:
            results = await asyncio.gather(*(self._work_item(item, delivery) for item in items),
                                           return_exceptions=True)
        finally:
            beat.cancel()
        for result in results:
            if isinstance(result, BaseException):  # as a single order's plain failure: nak, redelivered
                raise result
        done = group_done(order, results)  # type: ignore[arg-type]
        await self.bus.publish_durable(done_subject(self.stage), await self.done_codec.encode(done),
                                       msg_id=f"done.{order.msg_id}")

    async def _work_item(self, item: Any, delivery: Delivery) -> Any:
        async with self._item_slots:
            try:
                done = await self.work(item, delivery)
            except WorkRefused as e:
                log.warning("work_refused", stage=self.stage.value, key=item.key, attempt=item.attempt, reason=str(e))
                done = StageFailed(self.stage, item.key, item.attempt, str(e))
        return bound_to(done, item)

    async def _wanted_items(self, order: RolloutGroupOrder | RewardGroupOrder) -> list[bool]:
        """`_still_wanted` for each item of a group order (the reconciler answers each)."""
        num = len(order.items)
        answer = await self._ask_still_wanted(order)
        items = answer.get("current_items") if isinstance(answer, dict) else None
        if isinstance(items, list) and len(items) == num:
            return [item is not False for item in items]
        return [not (isinstance(answer, dict) and answer.get("current") is False)] * num

    async def _still_wanted(self, order: Any) -> bool:
        """The first heartbeat, as a question to the reconciler: a lost actor's orders are re-issued as new
        attempts at once, and the old ones, redelivered after the bus's ack wait, would be done twice."""
        answer = await self._ask_still_wanted(order)
        return not (isinstance(answer, dict) and answer.get("current") is False)

    async def _ask_still_wanted(self, order: Any) -> Any:
        """The reconciler's answer (decoded) to "is this attempt still wanted?"; None without one.

        A redelivered order is most often a lost actor's, and the reconciler, the one process that knows
        whether it was re-issued, may be down itself just then (killed and resuming): doing the order
        unasked redoes work the table already had done (whole rollouts, in the kill -9 test). So the
        question waits for an answer: a reconciler that does not answer in time (busy, stopped) is asked
        again, and with none subscribed the question waits for the next one to register (it subscribes
        before it registers). Only after ``still_wanted_patience_s`` without an answer is the order done
        anyway: nothing is lost either way, a superseded completion is ignored. An actor asked to drain
        meanwhile gives the order back (`OrderGoesBack`: nak'ed, redelivered) rather than start it."""
        beat = await self._work_heartbeat(order)
        subject = heartbeat_subject(self.stage)
        started, num_asked = time.monotonic(), 0
        try:
            async with asyncio.timeout(self.still_wanted_patience_s):
                while True:
                    if self._drain_requested.is_set():
                        raise OrderGoesBack(f"draining, and no reconciler said whether {order.key} is still wanted")
                    num_asked += 1
                    try:
                        reply = await self.bus.request(subject, beat, timeout_s=self.still_wanted_timeout_s)
                    except (BusTimeout, NoResponders) as e:
                        nobody = isinstance(e, NoResponders)
                        if num_asked == 1:
                            log.info("still_wanted_unanswered", stage=self.stage.value, key=order.key,
                                     reason="no reconciler is subscribed" if nobody
                                     else "the reconciler did not answer in time",
                                     patience_s=self.still_wanted_patience_s)
                        if nobody:  # else asked again at once: each ask is bounded
                            await self._unless_drained(self._next_reconciler_registration())
                        continue
                    if num_asked > 1:
                        log.info("still_wanted_answered", stage=self.stage.value, key=order.key,
                                 num_asked=num_asked, waited_s=round(time.monotonic() - started, 3))
                    return msgpack.unpackb(reply, raw=False)
        except TimeoutError:
            log.warning("still_wanted_never_answered", stage=self.stage.value, key=order.key, num_asked=num_asked,
                        waited_s=round(time.monotonic() - started, 3),
                        consequence="the order is done: if it was superseded, its completion is ignored")
            return None

    async def _next_reconciler_registration(self) -> None:
        """Returns on the next write of a reconciler's registry entry (a start or a lease renewal), not on
        the entries there now: a lapsing entry of the one that just died would answer nothing."""
        entries = self.bus.kv_watch("actors", registration_key(RECONCILER_KIND, "*"))
        async with contextlib.aclosing(entries):
            caught_up = False
            async for entry in entries:
                if entry is None:
                    caught_up = True
                elif caught_up and not entry.deleted:
                    return

    async def _work_heartbeat(self, order: Any) -> bytes:
        """A heartbeat for `order` (for each item of a group order), with its issuance token: the
        reconciler believes no other."""
        if isinstance(order, RolloutGroupOrder | RewardGroupOrder):
            return await self.heartbeat_codec.encode(WorkHeartbeats(tuple(
                WorkHeartbeat(self.stage, o.key, o.attempt, self.identity.actor_id, o.token) for o in order.items)))
        return await self.heartbeat_codec.encode(
            WorkHeartbeat(self.stage, order.key, order.attempt, self.identity.actor_id, order.token))

    async def environment_delay(self, model: LatencyModel, key: str) -> float:
        """Waits the environment's delay for the wait named ``key`` (``tasks.latency``, a slow environment on
        purpose) and returns it in seconds; a drain requested meanwhile ends the wait and gives the order back
        (`OrderGoesBack`: nak'ed and redelivered; a rollout resumes from its last checkpoint)."""
        delay = model.draw(key)
        if delay > 0 and not await self._unless_drained(asyncio.sleep(delay)):
            raise OrderGoesBack(f"draining during the environment's delay of {key} ({delay:.3f} s)")
        return delay

    async def _report_alive(self, order: Any) -> None:
        beat = await self._work_heartbeat(order)
        while True:  # the first beat at once: the reconciler learns who holds the order (re-issued if it is lost)
            with contextlib.suppress(Exception):
                await self.bus.publish(heartbeat_subject(self.stage), beat)
            await asyncio.sleep(self.heartbeat_every_s)

    # --- blobs: typed msgpack records (actors.records), zstd-compressed --------------------------
    async def put_record(self, key: str, record: Any, ready: bool = False) -> None:
        """Writes ``record`` to the blob store; ``ready``: also to the Ray object store when the run has one
        (runtime.ready_samples), after the durable copy, which stays the source of truth."""
        data = zstandard.ZstdCompressor(level=3).compress(encode_record(record))
        await self.ctx.blob.put(key, data)
        if ready and self.ctx.ready_samples is not None:
            await self.ctx.ready_samples.put(key, data)

    async def get_record(self, key: str, record_type: type[R], ready: bool = False) -> R:
        """The record of ``record_type`` at ``key``; WorkRefused when it is missing, corrupt, of another
        schema or not that type (no retry of this work reads it better: the reconciler retries or drops it).
        ``ready``: by reference from the Ray object store when it holds it (runtime.ready_samples), else from
        the blob store."""
        return await _read_record(self.ctx.blob, key, record_type, await self.ctx.ready_samples.get(key)
                                  if ready and self.ctx.ready_samples is not None else None)

    async def get_records(self, keys: list[str], record_type: type[R], ready: bool = False) -> list[R]:
        """`get_record` of each of ``keys``; ``ready``: those the Ray object store holds read in one go
        (``ready_samples_read``: how many reads of this process the store answered, how many the blob store)."""
        records = await self.get_records_each(keys, record_type, ready)
        for record in records:
            if isinstance(record, WorkRefused):
                raise record
        return records  # type: ignore[return-value]

    async def get_records_each(self, keys: list[str], record_type: type[R],
                               ready: bool = False) -> list[R | WorkRefused]:
        """As `get_records`, each key's record or why it cannot be used (missing, corrupt, another schema):
        one bad record refuses the work that needs it, not its neighbours'."""
        found: list[bytes | None] = [None] * len(keys)
        if ready and self.ctx.ready_samples is not None:
            found = await self.ctx.ready_samples.get_many(keys)
            log.info("ready_samples_read", num_hits=self.ctx.ready_samples.num_hits,
                     num_misses=self.ctx.ready_samples.num_misses)
        records: list[R | WorkRefused] = []
        for key, raw in zip(keys, found, strict=True):
            try:
                records.append(await _read_record(self.ctx.blob, key, record_type, raw))
            except WorkRefused as e:
                records.append(e)
        return records


async def _read_record(blob: Any, key: str, record_type: type[R], raw: bytes | None) -> R:
    """The record at ``key`` from ``raw`` (read from ``blob``, the run's store, when None)."""
    try:
        raw = raw if raw is not None else await blob.get(key)
    except KeyError:
        raise WorkRefused(f"blob {key!r} is missing") from None
    except ValueError as e:  # a key no stage writes (outside the store): no retry makes it readable
        raise WorkRefused(f"blob key {key[:200]!r} is invalid: {e}") from None
    try:
        data = zstandard.ZstdDecompressor().decompress(raw)
    except zstandard.ZstdError as e:
        raise WorkRefused(f"blob {key!r} is corrupt ({e})") from None
    try:
        return decode_record(data, record_type, key)
    except RecordError as e:
        raise WorkRefused(str(e)) from None
