"""Task format, loading, and the built-in generator (sizes, splits, references pass)."""

from __future__ import annotations

import json
import os

import pytest

from sandbox import (
    Environment,
    LayerStore,
    Task,
    dump_tasks_jsonl,
    generate_tasks,
    load_tasks_dir,
    load_tasks_jsonl,
    score,
)
from sandbox.config import SandboxLimits
from sandbox.task_generator import FAMILIES, all_tasks


def test_generated_tasks_are_small_graded_and_deterministic() -> None:
    tasks = generate_tasks(seed=3, n=200)
    assert [t.id for t in tasks] == [t.id for t in generate_tasks(seed=3, n=200)]
    assert [t.id for t in tasks] != [t.id for t in generate_tasks(seed=4, n=200)]
    assert len({t.id for t in tasks}) == 200
    for t in all_tasks("train") + all_tasks("heldout"):
        assert len(t.prompt.encode()) < 150, t.prompt
        assert len(t.reference_solution["solution.py"].encode()) < 120
        cases = json.loads(t.hidden_tests["tests/hidden_cases.json"])["cases"]
        assert len(cases) >= 5
        assert len({json.dumps(c["expected"]) for c in cases}) >= 2 or t.id.startswith("const")
    assert {t.difficulty for t in tasks} == {1, 2, 3, 4}


def test_splits_are_disjoint_and_cover_every_difficulty() -> None:
    train = {t.id for t in all_tasks("train")}
    heldout = {t.id for t in all_tasks("heldout")}
    assert not train & heldout
    assert len(heldout) > 0.1 * (len(train) + len(heldout))
    assert {t.difficulty for t in all_tasks("heldout")} == {1, 2, 3, 4}
    assert {t.id for t in generate_tasks(0, 50, split="heldout")} <= heldout
    assert {t.difficulty for t in generate_tasks(0, 20, difficulties=[2])} == {2}
    with pytest.raises(ValueError, match="holds"):
        generate_tasks(0, 10**6)
    with pytest.raises(ValueError, match="split"):
        generate_tasks(0, 1, split="test")


def test_task_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match=r"'\.\.'"):
        Task(id="t", prompt="p", files={"../x": ""}, test_command="true")
    with pytest.raises(ValueError, match="no hidden_tests and no test_command"):
        Task(id="t", prompt="p")
    with pytest.raises(ValueError, match=r"\*.json and \*.py"):
        Task(id="t", prompt="p", hidden_tests={"tests/run.sh": "exit 0"})
    with pytest.raises(ValueError, match="unknown keys"):
        Task.from_dict({"id": "t", "prompt": "p", "test_command": "true", "bogus": 1})


def test_jsonl_and_directory_roundtrip(tmp_path: object) -> None:
    tasks = generate_tasks(1, 5)
    custom = Task(
        id="custom",
        prompt="make it pass",
        files={"a.sh": "exit 1\n"},
        test_command="sh a.sh",
        limits=SandboxLimits(wall_time_s=7.0),
        difficulty=2,
    )
    path = os.path.join(str(tmp_path), "tasks.jsonl")
    dump_tasks_jsonl([*tasks, custom], path)
    assert load_tasks_jsonl(path) == [*tasks, custom]

    root = os.path.join(str(tmp_path), "dir")
    for t in tasks[:2]:
        d = os.path.join(root, t.id)
        for sub, files in (("files", t.files), ("hidden_tests", t.hidden_tests), ("reference", t.reference_solution)):
            for rel, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(d, sub, rel)), exist_ok=True)
                with open(os.path.join(d, sub, rel), "w") as f:
                    f.write(text)
        with open(os.path.join(d, "task.json"), "w") as f:
            json.dump({"prompt": t.prompt, "difficulty": t.difficulty}, f)
    assert sorted(load_tasks_dir(root), key=lambda t: t.id) == sorted(tasks[:2], key=lambda t: t.id)


async def test_reference_solutions_pass_and_stubs_fail(store: LayerStore) -> None:
    """One task per family, graded in the real sandbox."""
    by_family = {}
    for t in all_tasks("train") + all_tasks("heldout"):
        by_family.setdefault(t.id.split("-")[0], t)
    assert len(by_family) == len(FAMILIES)
    for task in by_family.values():
        with Environment.create(store, task.files) as env:
            stub = await score(env, task)
            assert stub.num_passed == 0 and stub.num_total == 5, task.id
        with Environment.create(store, {**task.files, **task.reference_solution}) as env:
            ref = await score(env, task)
            assert ref.num_passed == ref.num_total == 5, (task.id, ref.details)
