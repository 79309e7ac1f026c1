"""Public testing helpers for the lifecycle core: an in-memory `SlotStore`.

Not for production: the reconciler uses a JetStream KV bucket. The in-memory store keeps the same
revision semantics (one global, increasing sequence, as a JetStream stream does), so tests that
"crash" a core by dropping it and rebuilding from the same store exercise the resume path.
"""

from __future__ import annotations

from actors.reconciler.store import CasConflict, Entry

__all__ = ["InMemorySlotStore", "InjectedStoreFailure"]


class InjectedStoreFailure(ConnectionError):
    """Raised by `InMemorySlotStore` when an armed failure fires (a simulated crash mid-call)."""


class InMemorySlotStore:
    """A dict with compare-and-set; counts operations for benchmarks and tests."""

    def __init__(self) -> None:
        self._data: dict[str, Entry] = {}
        self._sequence = 0
        self.num_writes = 0
        self.num_reads = 0
        self.num_bulk_reads = 0
        self._writes_until_failure: int | None = None

    def fail_after(self, num_writes: int | None) -> None:
        """Make the write after the next `num_writes` writes raise `InjectedStoreFailure` (None disarms)."""
        self._writes_until_failure = num_writes

    def _check_armed(self, key: str) -> None:
        if self._writes_until_failure is None:
            return
        if self._writes_until_failure == 0:
            self._writes_until_failure = None
            raise InjectedStoreFailure(f"injected store failure writing {key!r}")
        self._writes_until_failure -= 1

    def _next(self) -> int:
        self._sequence += 1
        self.num_writes += 1
        return self._sequence

    async def get(self, key: str) -> Entry | None:
        self.num_reads += 1
        return self._data.get(key)

    async def create(self, key: str, value: bytes) -> int:
        self._check_armed(key)
        if key in self._data:
            raise CasConflict(key, None, self._data[key].revision)
        revision = self._next()
        self._data[key] = Entry(bytes(value), revision)
        return revision

    async def update(self, key: str, value: bytes, expected_revision: int) -> int:
        self._check_armed(key)
        current = self._data.get(key)
        actual = current.revision if current is not None else None
        if actual != expected_revision:
            raise CasConflict(key, expected_revision, actual)
        revision = self._next()
        self._data[key] = Entry(bytes(value), revision)
        return revision

    async def keys(self) -> list[str]:
        return list(self._data)

    async def items(self, prefix: str) -> dict[str, Entry]:
        self.num_bulk_reads += 1
        return {k: e for k, e in self._data.items() if k.startswith(prefix)}

    def snapshot(self) -> dict[str, bytes]:
        """A copy of every value, for assertions."""
        return {k: e.value for k, e in self._data.items()}
