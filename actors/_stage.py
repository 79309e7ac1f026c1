"""What every stage actor (rollout, reward, grouping, trainer) shares: take an order, do the work while
telling the reconciler it is alive, report the completion (or the failure) on ``done.<stage>``.

Completions carry the order's issuance token and are published durably with a message id of (stage,
key, attempt, token), so a redelivered order that is handled again reports the same completion and the
stream deduplicates it, and nobody who has not seen the order can pre-empt that id.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, ClassVar

import msgpack
import structlog
import zstandard

from actors.config import RLConfig
from actors.lifecycle_events import StageFailed, bound_to
from actors.messages import COMPLETION_TYPES, WorkHeartbeat, done_subject, order_types, work_queue_of
from actors.slots import Stage
from runtime.actor import Actor, ActorContext, Delivery
from runtime.bus_auth import BusAccess
from runtime.codec import Codec
from runtime.errors import BusTimeout, NoResponders

log = structlog.get_logger(__name__)

HEARTBEAT_SUBJECT = "heartbeat"


class WorkRefused(ValueError):
    """The order cannot be done by anyone (bad input, broken staleness bound): report it, do not retry."""


class StageActor(Actor):
    """Subclasses set ``stage`` and implement ``work(order) -> completion``."""

    stage: ClassVar[Stage]
    Config = RLConfig
    heartbeat_every_s: ClassVar[float] = 5.0
    still_wanted_timeout_s: ClassVar[float] = 2.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "stage" in cls.__dict__:
            cls.kind = cls.kind or cls.stage.value
            cls.queues = (work_queue_of(cls.stage),)
            cls.messages = order_types(cls.stage)
            # its completions and heartbeats, and nothing of another stage's
            cls.bus_access = cls.bus_access | BusAccess(publish=(done_subject(cls.stage),
                                                                 f"{HEARTBEAT_SUBJECT}.{cls.stage.value}"))

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.config: RLConfig
        self.done_codec = Codec(COMPLETION_TYPES)
        self.heartbeat_codec = Codec([WorkHeartbeat])

    async def work(self, order: Any, delivery: Delivery) -> Any:
        """Do the order; tasks it starts in ``delivery.task_group`` finish before the order is acked."""
        raise NotImplementedError

    async def handle(self, msg: Any, delivery: Delivery) -> None:
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

    async def _still_wanted(self, order: Any) -> bool:
        """The first heartbeat, as a question to the reconciler: a lost actor's orders are re-issued as new
        attempts at once, and the old ones, redelivered after the bus's ack wait, would be done twice.
        Without an answer in time (no reconciler, a slow one) the order is done."""
        beat = await self._work_heartbeat(order)
        try:
            reply = await self.bus.request(f"{HEARTBEAT_SUBJECT}.{self.stage.value}", beat,
                                           timeout_s=self.still_wanted_timeout_s)
        except (NoResponders, BusTimeout):
            return True
        answer = msgpack.unpackb(reply, raw=False)
        return not (isinstance(answer, dict) and answer.get("current") is False)

    async def _work_heartbeat(self, order: Any) -> bytes:
        """A heartbeat for `order`, with its issuance token: the reconciler believes no other."""
        return await self.heartbeat_codec.encode(
            WorkHeartbeat(self.stage, order.key, order.attempt, self.identity.actor_id, order.token))

    async def _report_alive(self, order: Any) -> None:
        beat = await self._work_heartbeat(order)
        while True:  # the first beat at once: the reconciler learns who holds the order (re-issued if it is lost)
            with contextlib.suppress(Exception):
                await self.bus.publish(f"{HEARTBEAT_SUBJECT}.{self.stage.value}", beat)
            await asyncio.sleep(self.heartbeat_every_s)

    # --- blobs: small msgpack records, zstd-compressed -----------------------------------------
    async def put_record(self, key: str, record: dict[str, Any]) -> None:
        await self.ctx.blob.put(key, zstandard.ZstdCompressor(level=3).compress(
            msgpack.packb(record, use_bin_type=True)))

    async def get_record(self, key: str) -> dict[str, Any]:
        try:
            raw = await self.ctx.blob.get(key)
        except KeyError:
            raise WorkRefused(f"blob {key!r} is missing; the stage that wrote it must run again") from None
        except ValueError as e:  # a key no stage writes (outside the store): no retry makes it readable
            raise WorkRefused(f"blob key {key[:200]!r} is invalid: {e}") from None
        try:
            return msgpack.unpackb(zstandard.ZstdDecompressor().decompress(raw), raw=False)
        except (zstandard.ZstdError, ValueError) as e:
            raise WorkRefused(f"blob {key!r} is corrupt ({e}); the stage that wrote it must run again") from None
