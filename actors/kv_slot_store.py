"""The lifecycle core's store on a JetStream KV bucket: every write a compare-and-set on the revision."""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from actors.slot_store import CasConflict, Entry

__all__ = ["KVSlotStore"]


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
