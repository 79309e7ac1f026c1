"""The built-in task generator: parameterised families of tiny Python tasks, split into train and held-out.

Every task asks for a one-line function ``f`` in ``solution.py``; prompts stay under 150 bytes
and reference solutions under 120 bytes so a tiny byte-level policy can learn them. Difficulty
grows from integer arithmetic (1) through strings (2) and lists (3) to compositions (4). Each
task has several hidden I/O cases (partial credit). A task belongs to the held-out split when a
hash of its id falls in one fifth of the range, so the splits are disjoint and stable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sandbox.tasks import Task

__all__ = ["FAMILIES", "Family", "all_tasks", "count_tasks", "generate_tasks", "split_of"]

HIDDEN_TESTS_PATH = "tests/hidden_cases.json"
NUM_CASES = 5


@dataclass(frozen=True)
class Family:
    name: str
    difficulty: int
    arg: str  # "x" int, "n" small non-negative int, "s" string, "a" list of ints
    params: tuple[dict[str, Any], ...]
    prompt: str  # formatted with the params
    body: str  # the returned expression, formatted with the params
    fn: Callable[..., Callable[[Any], Any]]  # params -> reference function


def _ks(lo: int, hi: int) -> tuple[dict[str, Any], ...]:
    return tuple({"k": k} for k in range(lo, hi + 1))


_CHARS = tuple({"c": c} for c in string.ascii_lowercase)

FAMILIES: tuple[Family, ...] = (
    Family("const", 1, "x", _ks(0, 99), "returns {k}", "{k}", lambda k: lambda x: k),
    Family("add", 1, "x", _ks(1, 99), "returns x plus {k}", "x+{k}", lambda k: lambda x: x + k),
    Family("sub", 1, "x", _ks(1, 99), "returns x minus {k}", "x-{k}", lambda k: lambda x: x - k),
    Family("mul", 1, "x", _ks(2, 99), "returns x times {k}", "x*{k}", lambda k: lambda x: x * k),
    Family("rep", 2, "s", _ks(2, 9), "returns s repeated {k} times", "s*{k}", lambda k: lambda s: s * k),
    Family("head", 2, "s", _ks(1, 9), "returns the first {k} characters of s", "s[:{k}]", lambda k: lambda s: s[:k]),
    Family("tail", 2, "s", _ks(1, 9), "returns the last {k} characters of s", "s[-{k}:]", lambda k: lambda s: s[-k:]),
    Family(
        "count",
        2,
        "s",
        _CHARS,
        "returns how many times '{c}' occurs in s",
        "s.count('{c}')",
        lambda c: lambda s: s.count(c),
    ),
    Family("append", 2, "s", _CHARS, "returns s followed by '{c}'", "s+'{c}'", lambda c: lambda s: s + c),
    Family(
        "gt",
        3,
        "a",
        _ks(0, 20),
        "returns how many items of list a are greater than {k}",
        "sum(v>{k} for v in a)",
        lambda k: lambda a: sum(v > k for v in a),
    ),
    Family(
        "scale",
        3,
        "a",
        _ks(2, 9),
        "returns list a with every item times {k}",
        "[v*{k} for v in a]",
        lambda k: lambda a: [v * k for v in a],
    ),
    Family(
        "maxk",
        3,
        "a",
        _ks(1, 20),
        "returns the largest item of list a plus {k}",
        "max(a)+{k}",
        lambda k: lambda a: max(a) + k,
    ),
    Family(
        "sumk", 3, "a", _ks(1, 20), "returns the sum of list a plus {k}", "sum(a)+{k}", lambda k: lambda a: sum(a) + k
    ),
    Family(
        "affine",
        4,
        "x",
        tuple({"k": k, "m": m} for k in range(2, 10) for m in range(1, 10)),
        "returns x times {k} plus {m}",
        "x*{k}+{m}",
        lambda k, m: lambda x: x * k + m,
    ),
    Family(
        "tri",
        4,
        "n",
        _ks(2, 9),
        "returns {k} times the sum of 1..n",
        "sum(range(n+1))*{k}",
        lambda k: lambda n: sum(range(n + 1)) * k,
    ),
    Family(
        "divis",
        4,
        "a",
        _ks(2, 9),
        "returns the items of list a divisible by {k}, in order",
        "[v for v in a if v%{k}==0]",
        lambda k: lambda a: [v for v in a if v % k == 0],
    ),
    Family(
        "digits",
        4,
        "n",
        _ks(0, 20),
        "returns the sum of the digits of n plus {k}",
        "sum(map(int,str(n)))+{k}",
        lambda k: lambda n: sum(map(int, str(n))) + k,
    ),
)


def split_of(task_id: str) -> str:
    """'heldout' for one fifth of ids (by hash), else 'train'."""
    h = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big")
    return "heldout" if h % 5 == 0 else "train"


def _inputs(arg: str, rng: random.Random, params: dict[str, Any]) -> list[Any]:
    if arg == "x":
        return [rng.randint(-50, 50) for _ in range(NUM_CASES)]
    if arg == "n":
        return [rng.randint(0, 200) for _ in range(NUM_CASES)]
    if arg == "s":
        alphabet = "abcde" + params.get("c", "") * 3
        return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(NUM_CASES)]
    return [[rng.randint(0, 30) for _ in range(rng.randint(1, 6))] for _ in range(NUM_CASES)]


def _make(family: Family, params: dict[str, Any]) -> Task:
    suffix = "-".join(str(v) for v in params.values())
    task_id = f"{family.name}-{suffix}"
    body = family.body.format(**params)
    fn = family.fn(**params)
    rng = random.Random(task_id)
    for _ in range(50):  # re-draw until the cases tell solutions apart (not all one answer)
        cases = [{"args": [v], "expected": fn(v)} for v in _inputs(family.arg, rng, params)]
        if len({json.dumps(c["expected"]) for c in cases}) >= 2:
            break
    spec = {"module": "solution", "function": "f", "cases": cases}
    return Task(
        id=task_id,
        prompt=f"Write f({family.arg}) in solution.py that {family.prompt.format(**params)}.",
        files={"solution.py": f"def f({family.arg}):\n    pass\n"},
        hidden_tests={HIDDEN_TESTS_PATH: json.dumps(spec)},
        test_command="",
        difficulty=family.difficulty,
        reference_solution={"solution.py": f"def f({family.arg}):\n    return {body}\n"},
    )


@functools.cache
def _every_task() -> tuple[Task, ...]:
    return tuple(_make(family, params) for family in FAMILIES for params in family.params)


def all_tasks(split: str) -> list[Task]:
    """Every generated task of ``split``, in a fixed order."""
    return [t for t in _every_task() if split_of(t.id) == split]


def count_tasks(split: str = "train", difficulties: Iterable[int] | None = None) -> int:
    """How many generated tasks ``split`` holds (of these difficulties): the largest ``n`` for `generate_tasks`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    wanted = None if difficulties is None else set(difficulties)
    return sum(1 for t in all_tasks(split) if wanted is None or t.difficulty in wanted)


def generate_tasks(seed: int, n: int, split: str = "train", difficulties: Iterable[int] | None = None) -> list[Task]:
    """``n`` distinct generated tasks of ``split`` ("train" or "heldout"), shuffled by ``seed``.

    The splits are disjoint by task identity (family and parameters). See `all_tasks`.

    Raises:
        ValueError: unknown split, or more tasks requested than the split holds.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    wanted = None if difficulties is None else set(difficulties)
    pool = [t for t in all_tasks(split) if wanted is None or t.difficulty in wanted]
    if not 0 <= n <= len(pool):
        raise ValueError(f"asked for n={n} tasks but split {split!r} holds {len(pool)}; lower n")
    rng = random.Random(seed)
    rng.shuffle(pool)
    return pool[:n]
