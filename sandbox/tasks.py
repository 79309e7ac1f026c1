"""Coding tasks: the `Task` format and JSONL/directory loading (the built-in generator: `sandbox.task_generator`).

A task gives the agent a prompt and starting files; its hidden tests are only copied into a fresh
fork at grading time (see `sandbox.reward`). With ``test_command == ""`` the built-in grader runs
the hidden tests (``*.json`` I/O cases, ``*.check.json`` HumanEval-style checks of a completed function:
`sandbox.task_file`, or ``*.py`` modules with ``test_*`` functions) and reports each test; any other
command is run as is and passes or fails as a whole by its exit code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandbox._safepath import split_relpath
from sandbox.config import SandboxLimits
from sandbox.errors import SandboxViolation

__all__ = [
    "Task",
    "dump_tasks_jsonl",
    "load_tasks_dir",
    "load_tasks_jsonl",
]


def _check_paths(task_id: str, what: str, files: Mapping[str, str]) -> None:
    for path, content in files.items():
        try:
            parts = split_relpath(path)
        except (SandboxViolation, TypeError) as e:
            raise ValueError(f"Task {task_id!r}: {what} path {path!r} is invalid: {e}") from e
        if not parts:
            raise ValueError(f"Task {task_id!r}: {what} path {path!r} names the workspace root; name a file")
        if not isinstance(content, str):
            raise ValueError(f"Task {task_id!r}: {what}[{path!r}] must be str, got {type(content).__name__}")


@dataclass(frozen=True)
class Task:
    """One coding task.

    Attributes:
        id: unique name.
        prompt: what the agent is asked to do.
        files: the starting workspace (path -> text).
        hidden_tests: test files (path -> text) copied in only at grading time.
        test_command: ``""`` for the built-in per-test grader, else a shell command whose exit
            code decides a single pass/fail.
        limits: sandbox limits for the agent's commands and for grading.
        difficulty: 1 (easiest) upward.
        reference_solution: files (path -> text) that pass every hidden test.
        metadata: free-form facts about the task (its source, tags) that grading never reads.
    """

    id: str
    prompt: str
    files: Mapping[str, str] = field(default_factory=dict)
    hidden_tests: Mapping[str, str] = field(default_factory=dict)
    test_command: str = ""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    difficulty: int = 1
    reference_solution: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Task.id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.prompt, str):
            raise ValueError(f"Task {self.id!r}: prompt must be str, got {type(self.prompt).__name__}")
        for what in ("files", "hidden_tests", "reference_solution"):
            _check_paths(self.id, what, getattr(self, what))
        if not self.hidden_tests and not self.test_command:
            raise ValueError(f"Task {self.id!r} has no hidden_tests and no test_command; give at least one")
        if not self.test_command:
            bad = [p for p in self.hidden_tests if not p.endswith((".json", ".py"))]
            if bad:
                raise ValueError(
                    f"Task {self.id!r}: the built-in grader runs *.json and *.py hidden tests, got {bad}; "
                    "rename them or set test_command"
                )
        if not isinstance(self.difficulty, int) or self.difficulty < 0:
            raise ValueError(f"Task {self.id!r}: difficulty must be an int >= 0, got {self.difficulty!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; limits are stored as the fields that differ from the defaults."""
        default = SandboxLimits()
        limits = {
            f.name: getattr(self.limits, f.name)
            for f in dataclasses.fields(SandboxLimits)
            if getattr(self.limits, f.name) != getattr(default, f.name)
        }
        return {
            "id": self.id,
            "prompt": self.prompt,
            "files": dict(self.files),
            "hidden_tests": dict(self.hidden_tests),
            "test_command": self.test_command,
            "limits": limits,
            "difficulty": self.difficulty,
            "reference_solution": dict(self.reference_solution),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Task:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"task record has unknown keys {unknown}; expected a subset of {sorted(known)}")
        if "id" not in data or "prompt" not in data:
            raise ValueError(f"task record needs 'id' and 'prompt', got keys {sorted(data)}")
        fields = dict(data)
        fields["limits"] = SandboxLimits(**dict(data.get("limits") or {}))
        return cls(**fields)


def load_tasks_jsonl(path: str | os.PathLike[str]) -> list[Task]:
    """One task per non-empty line (`Task.to_dict` format)."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tasks.append(Task.from_dict(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    return tasks


def dump_tasks_jsonl(tasks: Iterable[Task], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task.to_dict(), sort_keys=True) + "\n")


def _read_tree(root: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if not os.path.isdir(root):
        return out
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                raise ValueError(f"{full} is a symlink; task directories must hold plain files")
            with open(full, encoding="utf-8") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


def load_tasks_dir(path: str | os.PathLike[str]) -> list[Task]:
    """Load every ``<path>/<task>/`` holding ``task.json`` (prompt, test_command, difficulty,
    limits) and the trees ``files/``, ``hidden_tests/`` and ``reference/``; the id defaults to
    the directory name."""
    tasks = []
    for name in sorted(os.listdir(path)):
        task_dir = os.path.join(path, name)
        meta_path = os.path.join(task_dir, "task.json")
        if not os.path.isfile(meta_path):
            continue
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        meta.setdefault("id", name)
        meta["files"] = _read_tree(os.path.join(task_dir, "files"))
        meta["hidden_tests"] = _read_tree(os.path.join(task_dir, "hidden_tests"))
        meta["reference_solution"] = _read_tree(os.path.join(task_dir, "reference"))
        try:
            tasks.append(Task.from_dict(meta))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{task_dir}: {e}") from e
    return tasks
