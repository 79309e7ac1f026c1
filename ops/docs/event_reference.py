"""The event reference (docs/reference/events.md): every event kind the product's code emits.

Found by reading the source (`ast`), not by running it: a call of a level method (``info``, ``warning``,
``error``, ``exception``, ...) on a structlog logger, the logger being a name some module assigns from
``structlog.get_logger(...)`` or a logger's ``.bind(...)`` (``log``, ``self._log``), or such a call itself.
An event's name is its first argument: a string, or a parameter of the enclosing function whose callers in
the same module pass strings (``Bus._republished``'s ``gap_event``). A name the scan cannot read (an f-string,
a variable) is an error naming the line: the reference would miss that event, so the code gives its events
names a reader can find.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ops.docs.markdown import code, table

__all__ = ["PACKAGES", "PAGE", "Emit", "UnreadableEvent", "anchor", "emits", "render", "scan_module"]

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "runtime", "ops", "sandbox", "model", "low_precision")  # the product, not its tests
PAGE = "reference/events.md"
# The level an event line carries for each method (structlog's exception() logs at error, with the traceback)
LEVELS = {"debug": "debug", "info": "info", "msg": "info", "warning": "warning", "warn": "warning",
          "error": "error", "exception": "error", "critical": "critical", "fatal": "critical"}
SEVERITY = ("debug", "info", "warning", "error", "critical")
IDENTITY = ("time", "level", "event", "kind", "actor")  # on every event line (runtime.events.EventLog)
LOGGER_FACTORIES = ("get_logger", "bind", "new")  # calls that return a structlog logger
Function = ast.FunctionDef | ast.AsyncFunctionDef


class UnreadableEvent(ValueError):
    """An emitting call whose event name the scan cannot read."""


@dataclass(frozen=True)
class Emit:
    """One call that emits an event."""

    event: str
    level: str
    module: str  # dotted: runtime.bus
    line: int
    fields: tuple[str, ...]  # keyword arguments, the logger's bound ones and ``**name`` for a splat


def emits(repo: Path = REPO, packages: Iterable[str] = PACKAGES) -> list[Emit]:
    """Every emitting call in ``packages``' modules.

    Raises:
        UnreadableEvent: a call's event name is neither a string nor a parameter its module's callers give strings.
    """
    files = sorted(p for package in packages for p in (repo / package).rglob("*.py"))
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in files}
    loggers = {name for tree in trees.values() for name in _logger_names(tree)}
    found: list[Emit] = []
    for path, tree in trees.items():
        found += scan_module(tree, _module_name(path.relative_to(repo)), loggers)
    return found


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_factory_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name) and (
        (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in LOGGER_FACTORIES)


def _logger_names(tree: ast.Module) -> Iterator[str]:
    """The names (``log``, ``self._log``) a module assigns a logger to."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_factory_call(node.value):
            yield from (ast.unparse(t) for t in node.targets)


def _bound_fields(tree: ast.Module) -> dict[str, set[str]]:
    """Logger name -> the fields its ``.bind(...)`` in this module gives every event it emits."""
    bound: dict[str, set[str]] = defaultdict(set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_factory_call(node.value):
            call = node.value
            assert isinstance(call, ast.Call)
            for target in node.targets:
                bound[ast.unparse(target)] |= {k.arg for k in call.keywords if k.arg is not None}
    return bound


def scan_module(tree: ast.Module, module: str, loggers: set[str]) -> list[Emit]:
    """The emitting calls of one module; ``loggers``: the names any module assigns a logger to.

    Raises:
        UnreadableEvent: as `emits`.
    """
    bound = _bound_fields(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                and node.args):
            continue
        receiver = node.func.value
        name = ast.unparse(receiver)
        if name not in loggers and not _is_factory_call(receiver):
            continue
        fields = {k.arg if k.arg != "exc_info" else "exception" for k in node.keywords if k.arg is not None}
        # A splat of a name or a call says what it holds (``**counts``, ``**dataclasses.asdict(result)``); one of
        # a comprehension is only said to be there
        fields |= {f"**{_splat_name(k.value)}" for k in node.keywords if k.arg is None}
        fields |= bound.get(name, set())
        fields -= set(IDENTITY)
        if node.func.attr == "exception":
            fields.add("exception")
        for event in _event_names(node.args[0], node, tree, parents, module):
            found.append(Emit(event, LEVELS[node.func.attr], module, node.lineno, tuple(sorted(fields))))
    return found


def _splat_name(value: ast.expr) -> str:
    return ast.unparse(value) if isinstance(value, ast.Name | ast.Attribute | ast.Call) else "…"


def _event_names(arg: ast.expr, call: ast.Call, tree: ast.Module, parents: dict[ast.AST, ast.AST],
                 module: str) -> list[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    function = _enclosing_function(call, parents)
    if isinstance(arg, ast.Name) and function is not None:
        names = _parameter_values(function, arg.id, tree)
        if names:
            return names
    raise UnreadableEvent(f"{module}:{call.lineno}: the event name {ast.unparse(arg)} is not a string, nor a "
                          "parameter this module's callers pass strings to: name the event with a string "
                          "(ops.docs lists the events the code emits)")


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> Function | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node
    return None


def _parameter_values(function: Function, parameter: str, tree: ast.Module) -> list[str]:
    """The strings callers in ``tree`` pass as ``function``'s ``parameter`` (its string default too), or [] when
    it is no parameter or some caller passes something else."""
    positional = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    if parameter not in (*positional, *(a.arg for a in function.args.kwonlyargs)):
        return []
    values: list[str] = []
    default = _default_of(function, parameter)
    if isinstance(default, ast.Constant) and isinstance(default.value, str):
        values.append(default.value)
    is_method = bool(positional) and positional[0] in ("self", "cls")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        via_attribute = isinstance(node.func, ast.Attribute) and node.func.attr == function.name
        if not (via_attribute or (isinstance(node.func, ast.Name) and node.func.id == function.name)):
            continue
        given = next((k.value for k in node.keywords if k.arg == parameter), None)
        if given is None and parameter in positional:
            at = positional.index(parameter) - (1 if via_attribute and is_method else 0)
            given = node.args[at] if at < len(node.args) else None
        if given is None:
            continue  # the default's, counted above
        if not (isinstance(given, ast.Constant) and isinstance(given.value, str)):
            return []
        values.append(given.value)
    return sorted(set(values))


def _default_of(function: Function, parameter: str) -> ast.expr | None:
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True):
        if arg.arg == parameter:
            return default
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if arg.arg == parameter:
            return kw_default
    return None


def anchor(event: str) -> str:
    """The id of an event's row on the page (and of its section on the troubleshooting page): its name."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", event)


def render(found: list[Emit] | None = None) -> str:
    """The page's text: one row per event name, sorted, each with an anchor (``events.md#actor_crashed``)."""
    found = emits() if found is None else found
    by_event: dict[str, list[Emit]] = defaultdict(list)
    for emit in found:
        by_event[emit.event].append(emit)
    rows = []
    for event in sorted(by_event):
        sites = by_event[event]
        levels = sorted({e.level for e in sites}, key=SEVERITY.index)
        modules = sorted({e.module for e in sites})
        fields = sorted({f for e in sites for f in e.fields})
        rows.append([f'<span id="{anchor(event)}"></span>{code(event)}', ", ".join(levels),
                     ", ".join(code(m) for m in modules), ", ".join(code(f) for f in fields)])
    packages = ", ".join(f"{code(p + '/')}" for p in PACKAGES)
    return "\n".join([
        "# Event reference\n",
        "<!-- Generated by `python -m ops.docs` from the events the code emits: do not edit this page. -->\n",
        "Every event the product's code can emit, read from its source "
        f"({packages}): {len(rows)} event names. Each event is one JSON line in the run's log "
        "(`logs/<actor>.jsonl` in the run directory) and on the bus (`log.<kind>.<level>`), which `python -m ops.tail` "
        "follows and filters (`--event NAME`). Besides the fields listed, every line carries "
        f"{', '.join(code(f) for f in IDENTITY)} (runtime.events); an event logged with its exception carries its "
        "traceback as `exception`. The fields are the keyword arguments of the calls that emit it (and the fields "
        "its logger was bound with in the same module; `**name`: fields given as a mapping, `**…` as a computed "
        "one).\n",
        table(["Event", "Level", "Emitted by", "Fields"], rows),
    ])
