"""Whether the RL run has really ended: the check behind the evaluator's ``ctl.supervisor.finish``.

Finishing ends the run for good, so the supervisor believes the request only when the durable state agrees
(issue 31: a finish sent at version 2 of 10, with no final evaluation, ended a run as finished). The
request names the version whose evaluation ends the run; the reconciler's table (``slots``, which only the
reconciler writes) must show that version trained and it the last, by the step budget (``run.steps``) or
by the data having run out (no batch in training, no sample in flight, the version the table's own), and
the evaluation of that version must be stored in the run's metrics. Everything is only read.
"""

from __future__ import annotations

from typing import Any

from actors.reconciler.kv_store import KVSlotStore
from actors.reconciler.slot import Slot, SlotDecodeError
from actors.reconciler.store import META_KEY, SLOT_PREFIX
from actors.reconciler.work import MetaRecord
from runtime.blob import BlobNotFound, BlobStore
from runtime.bus import Bus
from runtime.metrics_log import metrics_key, numbered
from runtime.run_config import RunSection

__all__ = ["finish_request", "why_not_finished"]


def finish_request(by: str, version: int, reason: str) -> dict[str, Any]:
    """The body of the evaluator's ``ctl.supervisor.finish``: the evaluated last version, and why it is the last."""
    return {"by": by, "version": version, "reason": reason}


async def why_not_finished(bus: Bus, blob: BlobStore | None, run: RunSection, request: dict[str, Any]) -> str | None:
    """Why the durable state does not confirm that the run ended at ``request["version"]`` (None: it does)."""
    version = request.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return f"the request names no version (got {version!r}): send the evaluated last version as 'version'"
    store = KVSlotStore(bus, "slots")
    meta_entry = await store.get(META_KEY)
    try:
        meta = MetaRecord.decode(meta_entry.value) if meta_entry is not None else MetaRecord()
    except (SlotDecodeError, ValueError, KeyError, TypeError) as e:
        return f"the reconciler's table is unreadable: {e}"
    if meta.trainer_version < version:
        return f"version {version} is not trained: the reconciler's table is at version {meta.trainer_version}"
    if not 0 < run.steps <= version:  # short of the step budget: only the data running out ends the run
        if meta.batch_id:
            return (f"version {version} is short of run.steps={run.steps} and batch {meta.batch_id} is still in "
                    "training: the data did not run out")
        if version != meta.trainer_version:
            return f"version {version} is not the last: the table is at version {meta.trainer_version}"
        for key in await store.keys():
            entry = await store.get(key) if key.startswith(SLOT_PREFIX) else None
            if entry is not None and Slot.decode(entry.value).is_live:
                return (f"version {version} is short of run.steps={run.steps} and samples are still in flight "
                        f"({key} holds one): the data did not run out")
    if blob is None:
        return "the supervisor has no blob store to read the final evaluation from"
    try:
        await blob.get(metrics_key("eval", numbered(version)))
    except BlobNotFound:
        return f"no evaluation of version {version} is stored ({metrics_key('eval', numbered(version))})"
    return None
