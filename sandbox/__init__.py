"""Isolated coding environments: bubblewrap + overlayfs, snapshot/fork, agent tools, tasks, rewards."""

from sandbox.archive import export_snapshot, export_snapshot_bytes, import_snapshot, import_snapshot_bytes
from sandbox.config import SandboxConfig, SandboxLimits
from sandbox.env import CommandResult, Environment
from sandbox.errors import (
    SandboxError,
    SandboxStateError,
    SandboxUnavailable,
    SandboxViolation,
    SnapshotFormatError,
)
from sandbox.layers import LayerStore, Snapshot
from sandbox.pool import EnvironmentPool, PoolConfig
from sandbox.reward import TestCaseResult, TestOutcome, score
from sandbox.task_generator import generate_tasks
from sandbox.tasks import Task, dump_tasks_jsonl, load_tasks_dir, load_tasks_jsonl
from sandbox.tools import ToolBox, ToolResult

__all__ = [
    "CommandResult",
    "Environment",
    "EnvironmentPool",
    "LayerStore",
    "PoolConfig",
    "SandboxConfig",
    "SandboxError",
    "SandboxLimits",
    "SandboxStateError",
    "SandboxUnavailable",
    "SandboxViolation",
    "Snapshot",
    "SnapshotFormatError",
    "Task",
    "TestCaseResult",
    "TestOutcome",
    "ToolBox",
    "ToolResult",
    "dump_tasks_jsonl",
    "export_snapshot",
    "export_snapshot_bytes",
    "generate_tasks",
    "import_snapshot",
    "import_snapshot_bytes",
    "load_tasks_dir",
    "load_tasks_jsonl",
    "score",
]
