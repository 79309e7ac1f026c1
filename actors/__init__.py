"""Actors of the RL run, and the reconciler's transport-independent lifecycle core.

The core (`Lifecycle` and its parts) is re-exported here; actor classes live in their own modules.
"""

from actors.reconciler.lifecycle import CoreBroken, Lifecycle, LifecycleConfig, Resumption
from actors.reconciler.metrics import LifecycleSnapshot, StageLatency
from actors.reconciler.scheduling import FailedGroupPolicy, SchedulingConfig
from actors.reconciler.slot import IllegalTransition, SampleLifecycleError, Slot, SlotDecodeError, SlotState, Stage
from actors.reconciler.store import CasConflict, Entry, SlotStore
from actors.reconciler.task_cursor import CursorRecord, ListTaskSource, TaskCursor, TaskSource
from actors.reconciler.work import (
    Completion,
    GroupDone,
    GroupOrder,
    GroupOutcome,
    MetaRecord,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    StageFailed,
    TrainDone,
    TrainOrder,
    WorkOrder,
)

__all__ = [
    "CasConflict",
    "Completion",
    "CoreBroken",
    "CursorRecord",
    "Entry",
    "FailedGroupPolicy",
    "GroupDone",
    "GroupOrder",
    "GroupOutcome",
    "IllegalTransition",
    "Lifecycle",
    "LifecycleConfig",
    "LifecycleSnapshot",
    "ListTaskSource",
    "MetaRecord",
    "Resumption",
    "RewardDone",
    "RewardOrder",
    "RolloutDone",
    "RolloutOrder",
    "SampleLifecycleError",
    "SchedulingConfig",
    "Slot",
    "SlotDecodeError",
    "SlotState",
    "SlotStore",
    "Stage",
    "StageFailed",
    "StageLatency",
    "TaskCursor",
    "TaskSource",
    "TrainDone",
    "TrainOrder",
    "WorkOrder",
]
