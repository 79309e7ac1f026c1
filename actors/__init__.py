"""Actors of the RL run, and the reconciler's transport-independent lifecycle core.

The core (`Lifecycle` and its parts) is re-exported here; actor classes live in their own modules.
"""

from actors.lifecycle import CoreBroken, Lifecycle, LifecycleConfig, Resumption
from actors.lifecycle_events import (
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
from actors.lifecycle_metrics import LifecycleSnapshot, StageLatency
from actors.scheduling import FailedGroupPolicy, SchedulingConfig
from actors.slot_store import CasConflict, Entry, SlotStore
from actors.slots import IllegalTransition, SampleLifecycleError, Slot, SlotDecodeError, SlotState, Stage
from actors.task_cursor import CursorRecord, ListTaskSource, TaskCursor, TaskSource

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
