"""The pyfunc family: HumanEval-shaped training tasks, a function's signature and docstring to complete.

Each task is a function-completion task as HumanEval's are (`sandbox.task_file`): ``solution.py`` holds a
typed signature and a docstring with one or two examples, and a hidden ``check(candidate)`` of asserts runs
on prompt + completion with HumanEval's 3 s timeout, graded by the same ``*.check.json`` path. So a policy
trained here meets the benchmark's format (and its all-or-nothing verdict) without ever seeing a problem of
it: HumanEval stays held out (`sandbox.humaneval`), and the templates (`sandbox._pyfunc_templates`: strings,
lists, dicts and arithmetic at difficulties 1 to 4) are none of its problems.

A task is a template and one set of its parameter values; its id, ``pyfunc/<entry point>/<values>``, seeds
everything else, so every process derives the same tasks. The reference body is run here, in this process,
to write the examples and the tests (it is this module's own code, never a model's): the arguments are drawn
again until the tests have two different answers and tell the task from its neighbours (the same template,
the parameter values before and after), so a constant or the neighbour's solution fails. Splits are the
generator's (`sandbox.task_generator.split_of`: a fifth of ids held out, by hash).
"""

from __future__ import annotations

import functools
import random
import textwrap
from collections.abc import Callable, Iterable
from string import Template as Substitution
from typing import Any, NamedTuple

import msgspec

from sandbox._pyfunc_templates import TEMPLATES, Params, Template
from sandbox.task_file import DEFAULT_CHECK_TIMEOUT_S, TaskRecord, parse_task_lines
from sandbox.task_generator import split_of
from sandbox.tasks import Task

__all__ = ["DIFFICULTIES", "SOURCE", "count_pyfunc_tasks", "pyfunc_records", "pyfunc_tasks"]

SOURCE = "pyfunc"
DIFFICULTIES = tuple(sorted({t.difficulty for t in TEMPLATES}))
NUM_DRAWN_CASES = 6  # hidden tests drawn per task, besides the template's edge cases
_MAX_DRAWS = 50
_DOC_WIDTH = 96


def _slug(value: int | str) -> str:
    """A parameter value as an id part: numbers and letters as they are, other characters by code point."""
    text = str(value)
    return text if text.lstrip("-").isalnum() else "".join(f"x{ord(ch):02x}" for ch in text)


def _task_id(template: Template, params: Params) -> str:
    return f"{SOURCE}/{template.name}/{'-'.join(_slug(v) for v in params.values())}"


def _reference_body(template: Template, params: Params) -> str:
    """The reference completion of ``template`` with ``params``: its body, indented under the prompt."""
    return textwrap.indent(Substitution(template.body).substitute(params), "    ")


@functools.cache
def _reference(template_index: int, params_index: int) -> Callable[..., Any]:
    """The reference function, compiled from its own text (the one definition of what the task asks)."""
    template = TEMPLATES[template_index]
    params = template.params[params_index]
    source = f"def {template.name}({template.args}) -> {template.returns}:\n{_reference_body(template, params)}"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{_task_id(template, params)}>", "exec"), namespace)  # this module's own code
    return namespace[template.name]


class _Case(NamedTuple):
    """One hidden test: the arguments, the reference's answer, and whether a neighbour answers otherwise."""

    args: tuple[Any, ...]
    answer: Any
    telling: bool


def _neighbours(template_index: int, params_index: int) -> list[Callable[..., Any]]:
    """The references of the same template with the parameter values just before and after these."""
    template = TEMPLATES[template_index]
    return [_reference(template_index, i) for i in (params_index - 1, params_index + 1)
            if 0 <= i < len(template.params)]


def _arguments(template: Template, params: Params, rng: random.Random) -> list[tuple[Any, ...]]:
    """``NUM_DRAWN_CASES`` different drawn arguments (fewer only if the draw has fewer values), then the edges."""
    unique: dict[str, tuple[Any, ...]] = {}
    for _ in range(4 * NUM_DRAWN_CASES):
        args = template.draw(rng, params)
        unique.setdefault(repr(args), args)
        if len(unique) == NUM_DRAWN_CASES:
            break
    for args in template.edges:
        unique.setdefault(repr(args), args)
    return list(unique.values())


def _cases(template_index: int, params_index: int, rng: random.Random) -> list[_Case]:
    """Hidden tests with two answers or more, on which every neighbour's reference is wrong somewhere.

    One drawn value serves every call: a reference that changed its arguments would fail its own tests
    (tests/sandbox/test_pyfunc_tasks.py runs every task's).

    Raises:
        ValueError: no draw of arguments told the task apart (a template whose draw needs fixing).
    """
    template = TEMPLATES[template_index]
    fn = _reference(template_index, params_index)
    neighbours = _neighbours(template_index, params_index)
    for _ in range(_MAX_DRAWS):
        answers = [(args, fn(*args)) for args in _arguments(template, template.params[params_index], rng)]
        wrong = [[other(*args) != answer for args, answer in answers] for other in neighbours]
        if all(any(row) for row in wrong) and len({repr(answer) for _, answer in answers}) >= 2:
            return [_Case(args, answer, any(row[i] for row in wrong)) for i, (args, answer) in enumerate(answers)]
    raise ValueError(f"pyfunc template {template.name!r} with {dict(template.params[params_index])}: "
                     f"{_MAX_DRAWS} draws of arguments never told it from its neighbours; widen its draw")


def _call_text(name: str, args: tuple[Any, ...]) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def _examples(name: str, cases: list[_Case], num: int) -> list[_Case]:
    """The docstring's ``num`` examples: short ones that show the parameter at work (a neighbour would answer
    otherwise), with different answers."""
    by_length = sorted(cases, key=lambda case: len(_call_text(name, case.args) + repr(case.answer)))
    telling = [case for case in by_length if case.telling]
    chosen = [(telling or by_length)[0]]
    for case in (*telling, *by_length):
        if len(chosen) == num:
            break
        if repr(case.answer) not in {repr(c.answer) for c in chosen}:
            chosen.append(case)
    return chosen


def _prompt(template: Template, params: Params, examples: list[_Case], rng: random.Random) -> str:
    """The signature and a docstring: the description, then the examples in one of HumanEval's styles."""
    doc = textwrap.fill(Substitution(template.doc).substitute(params), _DOC_WIDTH, initial_indent="    ",
                        subsequent_indent="    ").lstrip()
    if rng.random() < 0.5:
        shown = "".join(f"    >>> {_call_text(template.name, c.args)}\n    {c.answer!r}\n" for c in examples)
    else:
        shown = "    For example:\n" + "".join(f"    {_call_text(template.name, c.args)} == {c.answer!r}\n"
                                              for c in examples)
    return f"def {template.name}({template.args}) -> {template.returns}:\n    \"\"\"{doc}\n\n{shown}    \"\"\"\n"


def _tests(cases: list[_Case]) -> str:
    asserts = "".join(f"    assert {_call_text('candidate', c.args)} == {c.answer!r}\n" for c in cases)
    return f"def check(candidate):\n{asserts}"


def _record(template_index: int, params_index: int) -> TaskRecord:
    template = TEMPLATES[template_index]
    params = template.params[params_index]
    task_id = _task_id(template, params)
    rng = random.Random(task_id)
    cases = _cases(template_index, params_index, rng)
    return TaskRecord(
        id=task_id,
        prompt=_prompt(template, params, _examples(template.name, cases, rng.choice((1, 2))), rng),
        entry_point=template.name,
        tests=_tests(cases),
        solution=_reference_body(template, params),
        difficulty=template.difficulty,
        split="heldout" if split_of(task_id) == "heldout" else "train",
        timeout_s=DEFAULT_CHECK_TIMEOUT_S,
        metadata={"source": SOURCE, "template": template.name},
    )


def _index() -> list[tuple[str, int]]:
    """(id, difficulty) of every task, in a fixed order, without building any."""
    return [(_task_id(t, p), t.difficulty) for t in TEMPLATES for p in t.params]


@functools.cache
def _every_task() -> tuple[tuple[TaskRecord, Task], ...]:
    lines = [msgspec.json.encode(_record(ti, pi)) for ti, t in enumerate(TEMPLATES) for pi in range(len(t.params))]
    return tuple(parse_task_lines(lines, SOURCE))  # the checks a task file's lines get


def _wanted(split: str | None, difficulties: Iterable[int] | None) -> Callable[[str, int], bool]:
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be 'train', 'heldout' or None, got {split!r}")
    levels = None if difficulties is None else set(difficulties)
    return lambda task_id, difficulty: ((split is None or split_of(task_id) == split)
                                        and (levels is None or difficulty in levels))


def pyfunc_records(split: str | None = None, difficulties: Iterable[int] | None = None) -> list[TaskRecord]:
    """The records of the pyfunc tasks of ``split`` (None: both) and ``difficulties`` (None: all), in a fixed
    order: what a task file would hold for them.

    Raises:
        ValueError: ``split`` is not train, heldout or None.
    """
    wanted = _wanted(split, difficulties)
    return [rec for rec, _ in _every_task() if wanted(rec.id, rec.difficulty)]


def pyfunc_tasks(split: str | None = None, difficulties: Iterable[int] | None = None) -> list[Task]:
    """The pyfunc tasks of ``split`` (None: both) and ``difficulties`` (None: all), in a fixed order.

    Raises:
        ValueError: ``split`` is not train, heldout or None.
    """
    wanted = _wanted(split, difficulties)
    return [task for rec, task in _every_task() if wanted(rec.id, rec.difficulty)]


def count_pyfunc_tasks(split: str | None = None, difficulties: Iterable[int] | None = None) -> int:
    """How many tasks `pyfunc_tasks` gives for these arguments, from the ids alone (builds no task).

    Raises:
        ValueError: ``split`` is not train, heldout or None.
    """
    wanted = _wanted(split, difficulties)
    return sum(1 for task_id, difficulty in _index() if wanted(task_id, difficulty))
