"""The reconciler: the actor that owns the slot table, and its transport-free lifecycle core.

Modules, one idea each:
    lifecycle      `Lifecycle`: the core's public events and call discipline, built by `Lifecycle.resume`
    table          `SlotTable`: the in-memory mirror of the stored slots, every write a compare-and-set
    issuance       `Issuance`: the work in flight, its attempts and tokens, and the orders to publish
    flow           `LifecycleFlow`: completions, retries, drops, batches, admission
    recovery       `recover`: bring a table loaded after a crash back to a consistent, running state
    slot           `Slot`: one table row, its states and legal transitions
    work           work orders, completions and the durable side records (meta, group outcomes)
    store          `SlotStore`: the compare-and-set store protocol and its key layout
    kv_store       `KVSlotStore`, `PipelinedKVSlotStore`: the store on a JetStream KV bucket
    scheduling     admission and batch selection (pure functions of the table's counts)
    task_cursor    the dataset cursor, durable beside the slots
    metrics        counters, latencies, the snapshot `ops.status` prints
    registry_view  the reconciler's view of the actor registry's leases
    data_exhaustion  whether a finished run's dataset is exhausted (read from the store)
    actor          `ReconcilerActor`: the core on NATS

The core is re-exported here; `ReconcilerActor` is loaded on first use (``actors.reconciler:ReconcilerActor``
in a run file): the actor imports the wire messages, which import the core's orders from this package.
"""

from typing import Any

from actors.reconciler.lifecycle import CoreBroken, Lifecycle, LifecycleConfig, Resumption

__all__ = ["CoreBroken", "Lifecycle", "LifecycleConfig", "ReconcilerActor", "Resumption"]


def __getattr__(name: str) -> Any:
    if name == "ReconcilerActor":
        from actors.reconciler.actor import ReconcilerActor

        return ReconcilerActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
