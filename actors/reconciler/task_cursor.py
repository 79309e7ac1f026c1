"""The dataset cursor: where in the task source the next admitted prompt comes from.

Prompts have a stable integer position in their `TaskSource`. The cursor record (epoch, position)
lives in the slot store beside the table, so a restarted reconciler continues at the same place:
no prompt is skipped and none repeated. The core writes an admitted group's slots *before*
advancing the cursor; a resume rolls back slots at or past the cursor (a half-written admission
whose work was never issued), so the cursor is always the exact boundary of admitted prompts.

In single-epoch mode (``num_epochs=1``, the default of the seeds' recipe) a prompt is never admitted,
hence never trained, twice; the cursor is exhausted at the end of the source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgpack

from actors.reconciler.slot import SlotDecodeError
from actors.reconciler.store import CURSOR_KEY, SlotStore

__all__ = ["CURSOR_SCHEMA_VERSION", "CursorRecord", "ListTaskSource", "Prompt", "TaskCursor", "TaskSource"]

CURSOR_SCHEMA_VERSION = 1


@runtime_checkable
class TaskSource(Protocol):
    """Prompts by stable position; `prompt_id(i)` must return the same id for the same i across restarts."""

    def __len__(self) -> int: ...

    def prompt_id(self, position: int) -> str: ...


@dataclasses.dataclass(frozen=True)
class ListTaskSource:
    """A task source over a fixed sequence of prompt ids (tests, simulations, small task sets)."""

    prompt_ids: Sequence[str]

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("ListTaskSource.prompt_ids is empty; give at least one prompt id")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def prompt_id(self, position: int) -> str:
        return self.prompt_ids[position]

    @classmethod
    def numbered(cls, num_prompts: int, prefix: str = "prompt") -> ListTaskSource:
        return cls(tuple(f"{prefix}-{i}" for i in range(num_prompts)))


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    epoch: int
    position: int
    prompt_id: str


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class CursorRecord:
    """The next prompt to admit is (epoch, position); ordering is lexicographic."""

    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.position < 0:
            raise ValueError(f"CursorRecord needs epoch, position >= 0, got ({self.epoch}, {self.position})")

    def to_dict(self) -> dict[str, Any]:
        return {"v": CURSOR_SCHEMA_VERSION, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CursorRecord:
        if data.get("v") != CURSOR_SCHEMA_VERSION:
            raise SlotDecodeError(f"cursor record schema version {data.get('v')!r} is not {CURSOR_SCHEMA_VERSION}")
        try:
            return cls(epoch=int(data["epoch"]), position=int(data["position"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SlotDecodeError(f"malformed cursor record {data!r}: {exc}") from exc

    def encode(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> CursorRecord:
        data = msgpack.unpackb(raw, raw=False)
        if not isinstance(data, dict):
            raise SlotDecodeError(f"cursor record must be a msgpack map, got {type(data).__name__}")
        return cls.from_dict(data)


class TaskCursor:
    """The durable cursor over a task source. Load with `TaskCursor.load`."""

    def __init__(
        self,
        store: SlotStore,
        source: TaskSource,
        num_epochs: int | None,
        record: CursorRecord,
        revision: int,
    ) -> None:
        if len(source) == 0:
            raise ValueError("task source is empty; the cursor needs at least one prompt")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (unbounded), got {num_epochs}")
        self._store = store
        self._source = source
        self._num_epochs = num_epochs
        self._record = record
        self._revision = revision

    @classmethod
    async def load(cls, store: SlotStore, source: TaskSource, num_epochs: int | None = 1) -> TaskCursor:
        """Read the cursor from `store`, creating it at (0, 0) on a fresh run."""
        entry = await store.get(CURSOR_KEY)
        if entry is None:
            record = CursorRecord()
            revision = await store.create(CURSOR_KEY, record.encode())
        else:
            record, revision = CursorRecord.decode(entry.value), entry.revision
        return cls(store, source, num_epochs, record, revision)

    @property
    def record(self) -> CursorRecord:
        return self._record

    @property
    def num_epochs(self) -> int | None:
        return self._num_epochs

    def _normalised(self, record: CursorRecord) -> CursorRecord:
        if record.position >= len(self._source):
            return CursorRecord(record.epoch + 1, 0)
        return record

    @property
    def is_exhausted(self) -> bool:
        record = self._normalised(self._record)
        return self._num_epochs is not None and record.epoch >= self._num_epochs

    def peek(self, num_prompts: int) -> list[Prompt]:
        """The next `num_prompts` prompts (fewer at the end of the last epoch), without advancing."""
        out: list[Prompt] = []
        record = self._record
        while len(out) < num_prompts:
            record = self._normalised(record)
            if self._num_epochs is not None and record.epoch >= self._num_epochs:
                break
            out.append(Prompt(record.epoch, record.position, self._source.prompt_id(record.position)))
            record = CursorRecord(record.epoch, record.position + 1)
        return out

    def after(self, prompt: Prompt) -> CursorRecord:
        return CursorRecord(prompt.epoch, prompt.position + 1)

    async def advance_to(self, record: CursorRecord) -> None:
        """Move the cursor forward to `record` with a compare-and-set.

        Raises:
            ValueError: `record` is behind the current cursor (the cursor never moves back).
            CasConflict: another writer moved the cursor.
        """
        if record < self._record:
            raise ValueError(f"cursor moves forward only: {self._record} → {record} is backwards")
        self._revision = await self._store.update(CURSOR_KEY, record.encode(), self._revision)
        self._record = record

    def admitted(self, epoch: int, position: int) -> bool:
        """True if the prompt at (epoch, position) is before the cursor, i.e. was admitted."""
        return (epoch, position) < (self._record.epoch, self._record.position)
