"""Task files (sandbox.task_file): records become function-completion tasks; every bad line names its line and field."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from sandbox import Environment, LayerStore, score
from sandbox.task_file import (
    CHECK_TESTS_PATH,
    SOLUTION_PATH,
    TaskFileError,
    load_task_file,
    with_completion,
)
from sandbox.task_generator import split_of

PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
GOOD: dict[str, Any] = {
    "id": "add/0",
    "prompt": PROMPT,
    "entry_point": "add",
    "tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
}


def _write(path: Path, records: list[Any]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_records_become_completion_tasks(tmp_path: Path) -> None:
    full = {**GOOD, "id": "add/1", "solution": "    return a + b\n", "files": {"notes/hint.txt": "use +\n"},
            "difficulty": 2, "split": "heldout", "timeout_s": 60.0, "metadata": {"source": "mine", "level": 2}}
    path = _write(tmp_path / "tasks.jsonl", [GOOD, "", {**full, "split": "train", "id": "add/2"}, full])
    tasks = load_task_file(path)
    assert [t.id for t in tasks] == ["add/0", "add/2", "add/1"]
    task = tasks[2]
    assert task.files == {"notes/hint.txt": "use +\n", SOLUTION_PATH: PROMPT}
    assert PROMPT in task.prompt and "add" in task.prompt
    assert json.loads(task.hidden_tests[CHECK_TESTS_PATH]) == {
        "solution": SOLUTION_PATH, "test": GOOD["tests"], "entry_point": "add", "timeout_s": 60.0}
    assert task.reference_solution == {SOLUTION_PATH: PROMPT + "    return a + b\n"}
    assert (task.difficulty, dict(task.metadata)) == (2, {"source": "mine", "level": 2})
    assert task.limits.wall_time_s >= 70.0  # the sandbox outlives the check's own 60 s
    assert tasks[0].limits.wall_time_s == 30.0 and tasks[0].reference_solution == {}
    by_hash = split_of("add/0")  # add/0 names no split: the id's hash decides, as for generated tasks
    train, heldout = (["add/0", "add/2"], ["add/1"]) if by_hash == "train" else (["add/2"], ["add/0", "add/1"])
    assert [t.id for t in load_task_file(path, "train")] == train
    assert [t.id for t in load_task_file(path, "heldout")] == heldout
    gz = tmp_path / "tasks.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_task_file(gz) == tasks
    assert with_completion(task, "    return a + b\n") == {**task.files, **task.reference_solution}


BAD_LINES: list[tuple[str, str, str]] = [  # (line, field, what the message says)
    ('{"id": "x", "prompt": ', "", "not valid JSON: input data was truncated"),
    ("[1, 2]", "", "expected 'object', got 'array'"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "id"}), "id", "missing required field 'id'"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "prompt"}), "prompt", "missing required field 'prompt'"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "entry_point"}), "entry_point", "missing required field"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "tests"}), "tests", "missing required field 'tests'"),
    (json.dumps({**GOOD, "test": "x"}), "test", "unknown field 'test'"),
    (json.dumps({**GOOD, "prompt": 3}), "prompt", "expected 'str', got 'int'"),
    (json.dumps({**GOOD, "files": {"a.txt": 1}}), "files", "expected 'str', got 'int'"),
    (json.dumps({**GOOD, "files": {"../a.txt": "x"}}), "files", "'..'"),
    (json.dumps({**GOOD, "files": {SOLUTION_PATH: "x"}}), "files", "made from the prompt"),
    (json.dumps({**GOOD, "split": "test"}), "split", "invalid enum value 'test'"),
    (json.dumps({**GOOD, "timeout_s": "3"}), "timeout_s", "expected 'float', got 'str'"),
    (json.dumps({**GOOD, "timeout_s": 0}), "timeout_s", "must be > 0"),
    (json.dumps({**GOOD, "difficulty": -1}), "difficulty", "difficulty must be an int >= 0"),
    (json.dumps({**GOOD, "metadata": {"tags": ["a"]}}), "metadata", "got 'array'"),
    (json.dumps({**GOOD, "id": " "}), "id", "non-empty"),
    (json.dumps({**GOOD, "entry_point": "add two"}), "entry_point", "not a Python identifier"),
    (json.dumps({**GOOD, "entry_point": "sub"}), "prompt", "no 'def sub('"),
    (json.dumps({**GOOD, "tests": "def check(candidate:\n"}), "tests", "not valid Python"),
    (json.dumps({**GOOD, "tests": "def test_add():\n    pass\n"}), "tests", "no top-level function check"),
    (json.dumps({**GOOD, "solution": "    return (a +\n"}), "solution", "prompt + solution is not valid Python"),
    (json.dumps({**GOOD, "id": "first"}), "id", "already the id of line 1"),
]


@pytest.mark.parametrize(("line", "field", "says"), BAD_LINES, ids=[f"{f or 'line'}-{i}" for i, (_, f, _) in
                                                                    enumerate(BAD_LINES)])
def test_each_bad_line_names_its_line_and_field(tmp_path: Path, line: str, field: str, says: str) -> None:
    path = _write(tmp_path / "tasks.jsonl", [{**GOOD, "id": "first"}, "", line])
    with pytest.raises(TaskFileError) as caught:
        load_task_file(path)
    error = caught.value
    assert (error.where, error.field) == (f"{path}:3", field), str(error)
    assert says in str(error)
    assert str(error).startswith(f"{path}:3: " + (f"field {field!r}: " if field else ""))
    assert isinstance(error, ValueError)


async def test_a_file_task_is_graded_by_its_check(tmp_path: Path, store: LayerStore) -> None:
    task = load_task_file(_write(tmp_path / "t.jsonl", [{**GOOD, "solution": "    return a + b\n"}]))[0]
    graded = {}
    for name, completion in (("right", "    return a + b\n"), ("wrong", "    return a - b\n"),
                             ("stub", "")):
        with Environment.create(store, with_completion(task, completion), task.limits) as env:
            graded[name] = (await score(env, task)).details[0]
    assert graded["right"].passed and graded["right"].detail == "passed"
    assert not graded["wrong"].passed and graded["wrong"].detail == "failed: "
    assert not graded["stub"].passed and graded["stub"].detail == "failed: "  # the docstring alone is a body
