"""The lifecycle core's store on a JetStream KV bucket: every write a compare-and-set on the revision.

`KVSlotStore` waits for each write's acknowledgement; `PipelinedKVSlotStore` buffers writes, sends
them back to back in `sync` and waits for one acknowledgement that covers them all (group commit),
for a reconciler that must not pay one round trip, nor one reply, per transition.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import Header
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from actors.slot_store import CasConflict, Entry
from actors.slots import SampleLifecycleError

__all__ = ["KVSlotStore", "PipelinedKVSlotStore", "StoreBroken"]


class StoreBroken(SampleLifecycleError, ConnectionError):
    """A pipelined write failed; the store may hold a prefix of its writes. Open a new one and resume."""


class KVSlotStore:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def get(self, key: str) -> Entry | None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        return Entry(entry.value, entry.revision)

    async def create(self, key: str, value: bytes) -> int:
        try:
            return await self._kv.create(key, value)
        except KeyWrongLastSequenceError:
            current = await self.get(key)
            raise CasConflict(key, None, current.revision if current else None) from None

    async def update(self, key: str, value: bytes, expected_revision: int) -> int:
        try:
            return await self._kv.update(key, value, last=expected_revision)
        except KeyWrongLastSequenceError:
            current = await self.get(key)
            raise CasConflict(key, expected_revision, current.revision if current else None) from None

    async def keys(self) -> list[str]:
        try:
            return list(await self._kv.keys())
        except NoKeysError:
            return []

    async def sync(self) -> None:
        """Every write made so far is durable (here: already, each write waited for its ack)."""


class PipelinedKVSlotStore(KVSlotStore):
    """A `KVSlotStore` whose writes are buffered and sent together by `sync` (group commit).

    (nats-py's ``publish_async`` is not used: its futures never resolve when the server refuses a
    write, nats-py 2.16 raising inside its reply handler instead.)

    Every write carries two conditions the server checks: the key's last revision (the
    compare-and-set) and the bucket stream's last sequence (the previous write of this store). So
    the writes apply in the order they were made, each only if all before it applied: the bucket
    always holds a prefix of them, as if the writer had crashed there, which a resume handles. A
    write's revision is known before it is sent (the stream's last sequence + 1, this store being
    the bucket's only writer), so the lifecycle core runs on without a round trip per transition.

    Because of that chain, only the last write of each `sync` asks for an acknowledgement: the
    server stores it only if every write before it was stored, so its acknowledgement confirms
    them all, and its refusal (its own conflict, or the broken chain of an earlier one) reports
    theirs. One reply per commit instead of one per write. Nothing may act on a write until `sync`
    returned: the reconciler publishes orders and acknowledges completions only after it.

    After any failed write (another writer, a lost connection, a timeout) the store is broken:
    every call raises `StoreBroken` and the owner must open a new store and resume from it.
    """

    def __init__(self, kv: KeyValue, nc: NatsClient, bucket: str, last_sequence: int, ack_timeout_s: float) -> None:
        super().__init__(kv)
        self._nc = nc
        self._subject_prefix = f"$KV.{bucket}."
        self._last = last_sequence  # sequence of the newest write made (buffered or sent)
        self._sent = last_sequence  # sequence of the newest write sent
        self._durable = last_sequence  # every write up to this one is acknowledged
        self._ack_timeout_s = ack_timeout_s
        self._order = asyncio.Lock()  # FIFO: buffers reach the connection in the order of their sequence
        self._buffer: list[tuple[str, bytes, int | None]] = []  # (key, value, expected revision), not sent
        self._writes: dict[int, tuple[str, int | None]] = {}  # acknowledgement asked: sequence -> (key, expected)
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of (sequence, id, future)
        self._broken: BaseException | None = None
        self._inbox = f"{nc.new_inbox()}."
        self._sub: Any = None

    @classmethod
    async def open(cls, nc: NatsClient, kv: KeyValue, bucket: str, ack_timeout_s: float = 10.0) -> PipelinedKVSlotStore:
        info = await nc.jetstream().stream_info(f"KV_{bucket}")
        store = cls(kv, nc, bucket, info.state.last_seq, ack_timeout_s)
        store._sub = await nc.subscribe(f"{store._inbox}*", cb=store._on_ack)
        return store

    async def close(self) -> None:
        """Stop listening for acknowledgements; writes not yet synced stay unconfirmed (or unsent)."""
        self._fail(StoreBroken("the store was closed"))
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def create(self, key: str, value: bytes) -> int:
        return self._write(key, value, None)

    async def update(self, key: str, value: bytes, expected_revision: int) -> int:
        return self._write(key, value, expected_revision)

    def _write(self, key: str, value: bytes, expected_revision: int | None) -> int:
        self._check()
        self._buffer.append((key, value, expected_revision))
        self._last += 1
        return self._last

    async def _send(self) -> None:
        """Send the buffered writes, chained on the stream's last sequence; the last one asks for a reply."""
        async with self._order:
            buffer, self._buffer = self._buffer, []
            if not buffer:
                return
            self._check()
            last = len(buffer) - 1
            for i, (key, value, expected) in enumerate(buffer):
                sequence = self._sent + 1
                headers = {
                    Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected or 0),
                    Header.EXPECTED_LAST_SEQUENCE: str(self._sent),
                }
                reply = ""
                if i == last:
                    self._writes[sequence] = (key, expected)
                    reply = f"{self._inbox}{sequence}"
                await self._nc.publish(self._subject_prefix + key, value, reply=reply, headers=headers)
                self._sent = sequence

    async def sync(self) -> None:
        """Send the buffered writes and wait until every write made so far is acknowledged.

        Raises:
            CasConflict: a write found another revision (or the chain was broken by another writer).
            StoreBroken: an earlier write failed, the connection failed, or no acknowledgement came
                within the timeout.
        """
        self._check()
        target = self._last
        if target <= self._durable:
            return
        await asyncio.sleep(0)  # let the other ready callers buffer their writes: one send, one reply for all
        await self._send()
        if target <= self._durable:
            return
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (target, id(waiter), waiter))
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._ack_timeout_s)
        except TimeoutError:
            self._fail(StoreBroken(f"writes up to sequence {target} not acknowledged within {self._ack_timeout_s}s"))
            self._check()

    async def _on_ack(self, msg: Msg) -> None:
        sequence = int(msg.subject[len(self._inbox) :])
        key, expected = self._writes.pop(sequence, ("?", None))
        if self._broken is not None:
            return
        if msg.headers and msg.headers.get("Status") == "503":
            self._fail(StoreBroken(f"no JetStream stream answered the write of {key!r}"))
            return
        try:
            reply = json.loads(msg.data)
        except ValueError as e:
            self._fail(StoreBroken(f"unreadable acknowledgement of the write of {key!r}: {e}"))
            return
        error = reply.get("error")
        if error and error.get("err_code") in (10071, 10164):  # wrong last (subject) sequence
            self._fail(CasConflict(key, expected, None))
        elif error:
            self._fail(StoreBroken(f"write of {key!r} failed: {error}"))
        elif reply.get("seq") != sequence:
            self._fail(
                StoreBroken(
                    f"write of {key!r} landed at sequence {reply.get('seq')}, not {sequence}: "
                    "another writer is using this bucket"
                )
            )
        else:  # the chain: every write up to this one is stored
            self._durable = max(self._durable, sequence)
            while self._waiters and self._waiters[0][0] <= self._durable:
                done = heapq.heappop(self._waiters)[2]
                if not done.done():
                    done.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self._broken = self._broken or error
        for _, _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(self._broken)
                waiter.exception()  # retrieved: a waiter that timed out meanwhile must not warn
        self._waiters.clear()

    async def get(self, key: str) -> Entry | None:
        await self.sync()  # a read sees every write made before it
        return await super().get(key)

    async def keys(self) -> list[str]:
        await self.sync()
        return await super().keys()

    def _check(self) -> None:
        if self._broken is not None:
            raise StoreBroken(f"an earlier write failed ({self._broken!r}); open a new store and resume")
