"""The durable dataset cursor."""

from __future__ import annotations

import pytest

from actors.reconciler.store import CasConflict
from actors.reconciler.task_cursor import CursorRecord, ListTaskSource, TaskCursor
from actors.testing import InMemorySlotStore

SOURCE = ListTaskSource.numbered(3)


async def test_single_epoch_walks_the_source_once_and_survives_reload() -> None:
    store = InMemorySlotStore()
    cursor = await TaskCursor.load(store, SOURCE)
    first = cursor.peek(2)
    assert [p.prompt_id for p in first] == ["prompt-0", "prompt-1"]
    await cursor.advance_to(cursor.after(first[-1]))
    reloaded = await TaskCursor.load(store, SOURCE)
    assert reloaded.record == CursorRecord(0, 2)
    assert [p.position for p in reloaded.peek(5)] == [2]
    assert reloaded.admitted(0, 1) and not reloaded.admitted(0, 2)
    await reloaded.advance_to(reloaded.after(reloaded.peek(1)[0]))
    assert reloaded.is_exhausted and reloaded.peek(1) == []


async def test_multi_epoch_wraps() -> None:
    cursor = await TaskCursor.load(InMemorySlotStore(), SOURCE, num_epochs=2)
    prompts = cursor.peek(10)
    assert [(p.epoch, p.position) for p in prompts] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    unbounded = await TaskCursor.load(InMemorySlotStore(), SOURCE, num_epochs=None)
    assert len(unbounded.peek(10)) == 10 and not unbounded.is_exhausted


async def test_never_moves_back_and_detects_a_second_writer() -> None:
    store = InMemorySlotStore()
    cursor = await TaskCursor.load(store, SOURCE)
    other = await TaskCursor.load(store, SOURCE)
    await cursor.advance_to(CursorRecord(0, 2))
    with pytest.raises(ValueError, match="forward only"):
        await cursor.advance_to(CursorRecord(0, 1))
    with pytest.raises(CasConflict, match="another reconciler"):
        await other.advance_to(CursorRecord(0, 1))


def test_empty_source_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        ListTaskSource(())
