"""The durable store the lifecycle core writes through: compare-and-set over string keys.

The reconciler backs it with a JetStream KV bucket (``update(key, value, last=revision)``); tests use
`actors.testing.InMemorySlotStore`. Every write names the revision it expects, so two reconcilers
that both believe they own the table cannot both succeed: the second gets `CasConflict`.

Key layout (all under one bucket):

- ``slot.<index>``: one `actors.reconciler.slot.Slot` record per table row.
- ``cursor``: the dataset cursor (`actors.reconciler.task_cursor.CursorRecord`).
- ``meta``: trainer version and run counters (`actors.reconciler.lifecycle.MetaRecord`).
- ``outcome.<group_id>``: a group that was dropped, or trained without its failed samples, with
  the reason (written before the group's slots are freed, so a resume can finish the job).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from actors.reconciler.slot import SampleLifecycleError

__all__ = [
    "CURSOR_KEY",
    "META_KEY",
    "OUTCOME_PREFIX",
    "SLOT_PREFIX",
    "CasConflict",
    "Entry",
    "SlotStore",
    "fenced_by_any_write",
    "outcome_key",
    "slot_key",
]

SLOT_PREFIX = "slot."
OUTCOME_PREFIX = "outcome."
CURSOR_KEY = "cursor"
META_KEY = "meta"
# "fence" (actors.reconciler.fence): which reconciler holds the table; never read by the lifecycle core


class CasConflict(SampleLifecycleError, RuntimeError):
    """A compare-and-set write found another revision (or an existing key on create).

    For the lifecycle core this means a second writer owns the table: the reconciler must stop.
    """

    def __init__(self, key: str, expected: int | None, actual: int | None) -> None:
        super().__init__(
            f"compare-and-set on {key!r} expected revision {expected} but found {actual}; "
            "another reconciler is writing this table: stop this one"
        )
        self.key = key
        self.expected = expected
        self.actual = actual


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    value: bytes
    revision: int


@runtime_checkable
class SlotStore(Protocol):
    """Compare-and-set key-value store (JetStream KV semantics).

    A store may also say (a class attribute ``fenced_by_any_write = True``) that each of its writers' writes is
    conditional on the whole store being as that writer last left it (`runtime.bus.ChainedKVWriter`): one
    write by a newer core then refuses every later write of an older one, so a resume need not rewrite each
    slot whose work it adopts (`fenced_by_any_write`).
    """

    async def get(self, key: str) -> Entry | None:
        """The current entry of `key`, or None if it does not exist."""
        ...

    async def create(self, key: str, value: bytes) -> int:
        """Create `key`; returns its revision. Raises `CasConflict` if it exists."""
        ...

    async def update(self, key: str, value: bytes, expected_revision: int) -> int:
        """Replace `key` if its revision is `expected_revision`; returns the new revision.

        Raises `CasConflict` on a mismatch or a missing key.
        """
        ...

    async def keys(self) -> list[str]:
        """All keys present."""
        ...

    async def items(self, prefix: str) -> dict[str, Entry]:
        """Every key starting with `prefix` and its entry, in one bulk read (a resume loads the table with
        it: one request per key would make a resume of 10^5 slots take minutes)."""
        ...


def fenced_by_any_write(store: SlotStore) -> bool:
    """Whether one write through `store` fences off every other writer of its table (see `SlotStore`)."""
    return bool(getattr(store, "fenced_by_any_write", False))


def slot_key(index: int) -> str:
    return f"{SLOT_PREFIX}{index}"


def outcome_key(group_id: str) -> str:
    return f"{OUTCOME_PREFIX}{group_id}"
