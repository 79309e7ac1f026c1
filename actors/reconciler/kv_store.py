"""The lifecycle core's store on a JetStream KV bucket: every write a compare-and-set on the revision.

`KVSlotStore` waits for each write's acknowledgement; `PipelinedKVSlotStore` buffers writes, sends
them back to back in `sync` and waits for one acknowledgement that covers them all (group commit,
`runtime.bus.ChainedKVWriter`), for a reconciler that must not pay one round trip, nor one reply,
per transition. Both speak to the bus through its KV API only (`Bus.kv_get`, `kv_create`, `kv_cas`,
`kv_keys`, `ChainedKVWriter`), never to nats-py.
"""

from __future__ import annotations

from actors.reconciler.slot import SampleLifecycleError
from actors.reconciler.store import CasConflict, Entry
from runtime.bus import Bus, ChainedKVWriter, ChainedWriteConflict, KVWriteFailed
from runtime.errors import RevisionMismatch

__all__ = ["KVSlotStore", "PipelinedKVSlotStore", "StoreBroken"]


class StoreBroken(SampleLifecycleError, ConnectionError):
    """A pipelined write failed; the store may hold a prefix of its writes. Open a new one and resume."""


class KVSlotStore:
    """The store on the bus's KV bucket `bucket` (the reconciler's: ``slots``); each write waits for its ack."""

    def __init__(self, bus: Bus, bucket: str = "slots") -> None:
        self._bus = bus
        self._bucket = bucket

    async def get(self, key: str) -> Entry | None:
        entry = await self._bus.kv_get(self._bucket, key)
        return Entry(entry.value, entry.revision) if entry is not None else None

    async def create(self, key: str, value: bytes) -> int:
        try:
            return await self._bus.kv_create(self._bucket, key, value)
        except RevisionMismatch:
            current = await self.get(key)
            raise CasConflict(key, None, current.revision if current else None) from None

    async def update(self, key: str, value: bytes, expected_revision: int) -> int:
        try:
            return await self._bus.kv_cas(self._bucket, key, value, expected_revision)
        except RevisionMismatch:
            current = await self.get(key)
            raise CasConflict(key, expected_revision, current.revision if current else None) from None

    async def keys(self) -> list[str]:
        return await self._bus.kv_keys(self._bucket)

    async def items(self, prefix: str) -> dict[str, Entry]:
        # the bus reads by NATS subject wildcards: every key, filtered here (prefixes end in ".")
        pattern = f"{prefix}>" if prefix.endswith(".") else ">"
        return {e.key: Entry(e.value, e.revision) for e in await self._bus.kv_items(self._bucket, pattern)
                if e.key.startswith(prefix)}

    async def sync(self) -> None:
        """Every write made so far is durable (here: already, each write waited for its ack)."""


class PipelinedKVSlotStore(KVSlotStore):
    """A `KVSlotStore` whose writes are buffered and sent together by `sync` (group commit).

    The writes apply in the order they were made, each only if all before it applied, so the bucket
    always holds a prefix of them, as if the writer had crashed there, which a resume handles. A
    write's revision is known before it is sent, so the lifecycle core runs on without a round trip
    per transition. Nothing may act on a write until `sync` returned: the reconciler publishes orders
    and acknowledges completions only after it.

    After any failed write (another writer, a lost connection, a timeout) the store is broken:
    every call raises `StoreBroken` and the owner must open a new store and resume from it.

    Each write is also conditional on the bucket's last sequence being this store's previous write: a write
    of any other writer (a newer core's, the fence's) refuses all of this store's later ones.
    """

    fenced_by_any_write = True

    def __init__(self, bus: Bus, bucket: str, writer: ChainedKVWriter) -> None:
        super().__init__(bus, bucket)
        self._writer = writer

    @classmethod
    async def open(cls, bus: Bus, bucket: str = "slots", ack_timeout_s: float = 10.0) -> PipelinedKVSlotStore:
        return cls(bus, bucket, await ChainedKVWriter.open(bus, bucket, ack_timeout_s))

    async def close(self) -> None:
        """Stop listening for acknowledgements; writes not yet synced stay unconfirmed (or unsent)."""
        await self._writer.close()

    async def create(self, key: str, value: bytes) -> int:
        return self._write(key, value, None)

    async def update(self, key: str, value: bytes, expected_revision: int) -> int:
        return self._write(key, value, expected_revision)

    def _write(self, key: str, value: bytes, expected_revision: int | None) -> int:
        try:
            return self._writer.write(key, value, expected_revision)
        except KVWriteFailed as e:
            raise StoreBroken(str(e)) from None

    async def sync(self) -> None:
        """Send the buffered writes and wait until every write made so far is acknowledged.

        Raises:
            CasConflict: a write found another revision (or the chain was broken by another writer).
            StoreBroken: an earlier write failed, the connection failed, or no acknowledgement came
                within the timeout.
        """
        try:
            await self._writer.flush()
        except ChainedWriteConflict as e:
            raise CasConflict(e.key, e.expected, None) from None
        except KVWriteFailed as e:
            raise StoreBroken(str(e)) from None

    async def get(self, key: str) -> Entry | None:
        await self.sync()  # a read sees every write made before it
        return await super().get(key)

    async def keys(self) -> list[str]:
        await self.sync()
        return await super().keys()

    async def items(self, prefix: str) -> dict[str, Entry]:
        await self.sync()
        return await super().items(prefix)
