"""Whether the RL run has really ended: the check behind the evaluator's ``ctl.supervisor.finish``.

Finishing ends the run for good, so the supervisor believes the request only when the durable state agrees
(a finish sent at version 2 of 10, with no final evaluation, must not end a run as finished). The
request names the version whose evaluation ends the run; the reconciler's table (``slots``, which only the
reconciler writes) must show that version trained and it the last, by the step budget (``run.steps``) or
by the data having run out (`why_data_not_run_out`, the check a ``data_exhausted`` claim gets: the dataset
cursor past the last epoch, no batch in training, no sample in flight, the version the table's own), and
the evaluation of that version must be stored in the run's metrics. Everything is only read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from actors.config import RLConfig
from actors.reconciler.data_exhaustion import why_data_not_run_out
from actors.reconciler.kv_store import KVSlotStore
from actors.reconciler.slot import SlotDecodeError
from actors.reconciler.store import META_KEY
from actors.reconciler.work import MetaRecord
from actors.task_catalog import TaskCatalog
from runtime.blob import BlobNotFound, BlobStore
from runtime.bus import Bus
from runtime.metrics_log import metrics_key, numbered
from runtime.run_config import RunSection

__all__ = ["finish_request", "why_not_finished"]


def finish_request(by: str, version: int, reason: str) -> dict[str, Any]:
    """The body of the evaluator's ``ctl.supervisor.finish``: the evaluated last version, and why it is the last."""
    return {"by": by, "version": version, "reason": reason}


async def why_not_finished(bus: Bus, blob: BlobStore | None, run: RunSection, config: RLConfig | None,
                           request: dict[str, Any]) -> str | None:
    """Why the durable state does not confirm that the run ended at ``request["version"]`` (None: it does).
    ``config``: the run's application config (its tasks and epochs say where the data runs out)."""
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
        if config is None:
            return (f"version {version} is short of run.steps={run.steps} and the supervisor has no application "
                    "config to tell whether the data ran out (runtime.up passes it to the Supervisor)")
        # the dataset cursor too, not only an empty table: a table with nothing in flight is also a run's start
        source = await asyncio.to_thread(TaskCatalog.build, config.tasks)  # generated: off the supervisor's loop
        why = await why_data_not_run_out(version, store=store, source=source,
                                         num_epochs=config.reconciler.num_epochs)
        if why is not None:
            return f"version {version} is short of run.steps={run.steps} and the data did not run out: {why}"
    if blob is None:
        return "the supervisor has no blob store to read the final evaluation from"
    try:
        await blob.get(metrics_key("eval", numbered(version)))
    except BlobNotFound:
        return f"no evaluation of version {version} is stored ({metrics_key('eval', numbered(version))})"
    return None
