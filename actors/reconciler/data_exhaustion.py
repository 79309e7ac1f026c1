"""Checking a ``data_exhausted.<run>`` claim against the reconciler's durable table before believing it.

The claim ends the run (the evaluator evaluates the named version and finishes), so whoever hears it
confirms it against the state it speaks of: the reconciler's cursor in the ``slots`` bucket must be
past the last prompt of the last epoch, no batch may be in training, no slot may hold a sample, and
the named version must be the table's own trainer version. A claim from anyone else, for another
run or another version, is refused with the reason; the table is only read, never written.
"""

from __future__ import annotations

from actors.messages import DataExhausted
from actors.reconciler.slot import Slot, SlotDecodeError
from actors.reconciler.store import CURSOR_KEY, META_KEY, SLOT_PREFIX, SlotStore
from actors.reconciler.task_cursor import CursorRecord, TaskCursor, TaskSource
from actors.reconciler.work import MetaRecord

__all__ = ["why_data_not_run_out", "why_not_exhausted"]


async def why_not_exhausted(
    claim: DataExhausted, *, run: str, store: SlotStore, source: TaskSource, num_epochs: int | None
) -> str | None:
    """Why the durable table does not confirm `claim` (None: it does).

    Args:
        claim: the message heard on ``data_exhausted.<run>``.
        run: the listener's own run name.
        store: the reconciler's slot store (read only).
        source, num_epochs: the run's task source and epochs, as the reconciler has them.
    """
    if claim.run != run:
        return f"run {claim.run!r} is not this run {run!r}"
    return await why_data_not_run_out(claim.version, store=store, source=source, num_epochs=num_epochs)


async def why_data_not_run_out(
    version: int, *, store: SlotStore, source: TaskSource, num_epochs: int | None
) -> str | None:
    """Why the durable table does not show the data run out at `version` (None: it does): the one check of it,
    for a ``data_exhausted`` claim and for a finish short of the step budget (`actors.run_end`)."""
    cursor_entry, meta_entry = await store.get(CURSOR_KEY), await store.get(META_KEY)
    if cursor_entry is None or meta_entry is None:
        return "the reconciler's table has no cursor or meta record yet"
    try:
        record, meta = CursorRecord.decode(cursor_entry.value), MetaRecord.decode(meta_entry.value)
    except (SlotDecodeError, ValueError, KeyError, TypeError) as e:
        return f"the reconciler's table is unreadable: {e}"
    if not TaskCursor(store, source, num_epochs, record, cursor_entry.revision).is_exhausted:
        return f"the dataset cursor is at epoch {record.epoch} position {record.position}: prompts remain"
    if meta.batch_id:
        return f"batch {meta.batch_id} is still in training"
    if version != meta.trainer_version:
        return f"version {version} is not the reconciler's version {meta.trainer_version}"
    for key in await store.keys():  # last: the one check that reads the whole table
        entry = await store.get(key) if key.startswith(SLOT_PREFIX) else None
        if entry is not None and Slot.decode(entry.value).is_live:
            return f"samples are still in flight ({key} holds one)"
    return None
