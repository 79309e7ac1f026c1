"""The long-context task family: facts spread over several files that must be read one by one and combined.

A task asks for ``f(i)`` in ``solution.py`` returning the key written at the end of ``notes/<i>.txt`` for
i = 1, 2, 3 (the answer combines the three: ``return (8,9,4)[i-1]``). Each note is mostly filler, so
reading all three (one ``read_file`` each: the agent cannot know a key without reading its file), plus
the prompt, the calls and the answer, takes about 800 tokens of the byte-level policy: more than one
640-token window holds. An agent whose window ends before the last read fails; one
that summarizes the keys it has read can finish in a second window. The hidden tests are I/O cases as
for the built-in generator, one per note (partial credit: each key right is a third of the tests).

Splits are the generator's (``sandbox.task_generator.split_of``: one fifth of ids held out), and every
task's text is a function of its id alone, so every process derives the same tasks.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass

from sandbox.task_generator import HIDDEN_TESTS_PATH, split_of
from sandbox.tasks import Task

__all__ = ["DIFFICULTY", "NOTE_PATHS", "NoteFacts", "all_long_context_tasks", "count_long_context_tasks",
           "generate_long_context_tasks", "note_facts"]

DIFFICULTY = 5
NOTE_PATHS = ("notes/1.txt", "notes/2.txt", "notes/3.txt")
FILLER_BYTES = 100  # per note, before its key line
_WORDS = ("log", "ok", "tmp", "run", "sync", "step", "warm", "idle", "skip", "seen", "copy", "load", "fast", "slow")


@dataclass(frozen=True)
class NoteFacts:
    """What a task hides in its notes: each note's path and key digit."""

    keys: tuple[tuple[str, int], ...]

    @property
    def answer(self) -> str:
        """The expression of the reference solution: ``(8,9,4)[i-1]``."""
        return f"({','.join(str(k) for _, k in self.keys)})[i-1]"


def _filler(rng: random.Random) -> str:
    lines, size = [], 0
    while size < FILLER_BYTES:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 5))) + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def _make(number: int) -> Task:
    task_id = f"notes-{number}"
    rng = random.Random(task_id)
    digits = [int(c) for c in str(number)]
    files = {path: f"{_filler(rng)}key: {digit}\n" for path, digit in zip(NOTE_PATHS, digits, strict=True)}
    files["solution.py"] = "def f(i):\n    pass\n"
    cases = [{"args": [i], "expected": digit} for i, digit in enumerate(digits, start=1)]
    spec = {"module": "solution", "function": "f", "cases": cases}
    return Task(
        id=task_id,
        prompt="Write f(i) in solution.py that returns the key in notes/i.txt, for each of notes/1.txt, "
               "notes/2.txt, notes/3.txt.",
        files=files,
        hidden_tests={HIDDEN_TESTS_PATH: json.dumps(spec)},
        test_command="",
        difficulty=DIFFICULTY,
        reference_solution={"solution.py": f"def f(i):\n    return ({','.join(map(str, digits))})[i-1]\n"},
    )


@functools.cache
def _every_task() -> tuple[Task, ...]:
    return tuple(_make(n) for n in range(100, 1000))


def note_facts(task: Task) -> NoteFacts:
    """The keys of a long-context task, read from its notes (ValueError for a task of another family)."""
    keys = []
    for path in NOTE_PATHS:
        text = task.files.get(path)
        last = text.rstrip("\n").rsplit("\n", 1)[-1] if text else ""
        if not last.startswith("key: ") or not last[5:].isdigit():
            raise ValueError(f"task {task.id!r} is not a long-context task: {path} has no key line")
        keys.append((path, int(last[5:])))
    return NoteFacts(tuple(keys))


def all_long_context_tasks(split: str) -> list[Task]:
    """Every long-context task of ``split``, in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [t for t in _every_task() if split_of(t.id) == split]


def count_long_context_tasks(split: str = "train") -> int:
    return len(all_long_context_tasks(split))


def generate_long_context_tasks(seed: int, n: int, split: str = "train") -> list[Task]:
    """``n`` distinct long-context tasks of ``split``, shuffled by ``seed``.

    Raises:
        ValueError: unknown split, or more tasks requested than the split holds.
    """
    pool = all_long_context_tasks(split)
    if not 0 <= n <= len(pool):
        raise ValueError(f"asked for n={n} long-context tasks but split {split!r} holds {len(pool)}; lower n")
    random.Random(seed).shuffle(pool)
    return pool[:n]
