"""The layers as the import graph shows them (docs/ARCHITECTURE.md, "Layers"), checked from the source (AST).

- No import circle among the project's modules, counting imports inside functions too: a circle
  dodged by importing inside a function (it then runs when called, not when the module loads) is still
  two modules that need each other. ``if TYPE_CHECKING:`` blocks never run and are not counted. Importing
  ``a.b.c`` runs the packages ``a`` and ``a.b`` first, but a package importing its own submodules is no
  circle, so only what an import names is an edge.
- ``runtime`` imports nothing of ``actors``, ``ops``, ``model``, ``low_precision`` or ``sandbox``: it is a
  runtime for any application, which names its actors in the run file.
- ``model``, ``low_precision`` and ``sandbox`` import nothing of ``actors``, ``ops`` or ``runtime``; ``ops``
  (operator commands) imports nothing of ``actors``.
- Only ``runtime/bus.py`` imports nats-py, and nothing reaches past a ``Bus`` to its client (``bus.nc``,
  ``bus.js``). ``PENDING_NATS`` lists the files still being moved behind the Bus API, each with its
  reason; an entry that no longer imports nats fails, so the list stays true.
- The reconciler's process loads no torch (nor numpy, Ray or Hugging Face's libraries): checked in a fresh
  interpreter doing what ``runtime.actor_process`` does before the actor runs. A frozen reconciler is replaced
  within its lease; torch alone takes 6-7 s of CPU of a replacement's start.
- Nor do the reward and grouping processes, the stage base and the records they are built of, or the
  simulated stages of the integration tests (numpy allowed: the router choices of a record are an int16
  array): they do no tensor work, and are started and restarted by the hundred.

The layer rules count every import, function-level and TYPE_CHECKING ones included: a layer that needs
another's names at type-checking time depends on it all the same.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "actors", "ops", "model", "low_precision", "sandbox")
FORBIDDEN = {  # package -> the packages it must not import
    "runtime": {"actors", "ops", "model", "low_precision", "sandbox"},
    "model": {"actors", "ops", "runtime"},
    "low_precision": {"actors", "ops", "runtime"},
    "sandbox": {"actors", "ops", "runtime"},
    "ops": {"actors"},
}
HEAVY = ("torch", "numpy", "triton", "safetensors", "ray", "transformers", "tokenizers")  # none in a reconciler
NATS_OWNER = "runtime/bus.py"
PENDING_NATS: dict[str, str] = {}  # file -> why it still imports nats-py (none: every caller is behind the Bus API)


@dataclass(frozen=True)
class Import:
    module: str  # the project module (or package) the import names
    line: int
    at_module_level: bool  # runs when the importing module loads
    type_checking: bool = False  # under ``if TYPE_CHECKING:``: never runs


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(body: list[ast.stmt], at_module_level: bool,
          type_checking: bool = False) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement under ``body``: whether it runs when the module loads, and whether it never runs."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, at_module_level, type_checking
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(node.body, False, type_checking)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, False, True)
            yield from _walk(node.orelse, at_module_level, type_checking)
        else:  # class bodies, try/if/with blocks at module level run at import time
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _walk([c for c in children if isinstance(c, ast.stmt | ast.excepthandler)],
                                     at_module_level, type_checking)


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    """The project modules that ``name`` (at ``path``) imports, plus nats-py as the module ``nats``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node, at_module_level, type_checking in _walk(tree.body, True):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from a import b``: the submodule a.b if there is one, else a name of the package a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if target.split(".")[0] == "nats":
                found.append(Import("nats", node.lineno, at_module_level, type_checking))
            elif target.split(".")[0] in PACKAGES:
                found.append(Import(target, node.lineno, at_module_level, type_checking))
    return found


def import_graph() -> dict[str, list[tuple[str, Path, Import]]]:
    files = project_files()
    modules = set(files)
    return {name: [(name, path, i) for i in imports_of(name, path, modules)] for name, path in files.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # the graph is a few hundred modules: recursion depth is no concern
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_project_has_no_import_circle() -> None:
    graph = import_graph()
    edges = {name: {i.module for _, _, i in imports if not i.type_checking and i.module in graph}
             for name, imports in graph.items()}
    assert circles(edges) == [], "import circles: break them (an import moved into a function hides one)"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_of_the_layers_above_it(package: str) -> None:
    wrong = [f"{path.relative_to(REPO)}:{i.line} imports {i.module}"
             for name, imports in import_graph().items() if name.split(".")[0] == package
             for _, path, i in imports if i.module.split(".")[0] in FORBIDDEN[package]]
    assert wrong == [], f"{package} must not import {sorted(FORBIDDEN[package])}"


def test_only_the_bus_imports_nats() -> None:
    importers = {str(path.relative_to(REPO)) for imports in import_graph().values()
                 for _, path, i in imports if i.module == "nats"}
    assert NATS_OWNER in importers, "runtime/bus.py is the one module that talks to nats-py"
    assert sorted(importers - {NATS_OWNER} - set(PENDING_NATS)) == [], "talk to NATS through runtime.bus.Bus"
    assert sorted(set(PENDING_NATS) - importers) == [], "no longer imports nats: remove it from PENDING_NATS"


def _client_uses(tree: ast.AST) -> list[int]:
    """Lines that reach past a bus to its nats-py client or JetStream context (``bus.nc``, ``self.bus.js``)."""
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in ("nc", "js")
                  and ast.unparse(node.value).split(".")[-1] == "bus")


def test_nothing_reaches_past_the_bus_to_its_nats_client() -> None:
    found = {str(path.relative_to(REPO)): lines for path in project_files().values() if path != REPO / NATS_OWNER
             if (lines := _client_uses(ast.parse(path.read_text(encoding="utf-8"))))}
    assert {f: lines for f, lines in found.items() if f not in PENDING_NATS} == {}, "use the Bus API"


# What an actor process loads before its actor runs (runtime.actor_process._serve), step by step: its entry module
# with the kind's class, then the run's configuration read as a process of the kind reads it (find_run). Each
# step prints the forbidden modules loaded so far; the default run's file stands for the run's stored configuration.
_ACTOR_PROCESS = """
import json, sys
from pathlib import Path
loaded = lambda: sorted(m for m in {forbidden!r} if m in sys.modules)
import runtime.actor_process
from runtime.run_config import import_entry
import_entry({entry!r})
print(json.dumps(["the {kind}'s class", loaded()]), flush=True)
from runtime.run_config import load_kind_config
load_kind_config([Path("actors/run.toml")], {kind!r})
print(json.dumps(["the run's configuration", loaded()]), flush=True)
"""


def _steps_loading(script: str, num_steps: int) -> list[list]:
    """The steps of ``script`` (run in a fresh interpreter) that loaded a forbidden module, with those modules."""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    steps = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and len(steps) == num_steps, done.stderr
    return [step for step in steps if step[1]]


def test_the_reconciler_process_loads_no_torch() -> None:
    script = _ACTOR_PROCESS.format(forbidden=HEAVY, entry="actors.reconciler:ReconcilerActor", kind="reconciler")
    assert _steps_loading(script, 2) == [], "heavy modules loaded by these steps"


# The stages that do no tensor work: they read and write records (router choices as numpy: numpy is allowed)
# and are restarted often (kills, health replacements); torch cost each start ~3 s of CPU and ~250 MB.
NO_TENSOR_WORK = tuple(m for m in HEAVY if m != "numpy")


@pytest.mark.parametrize(("entry", "kind"), [("actors.stages.reward:RewardActor", "reward"),
                                             ("actors.stages.grouping:GroupingActor", "grouping")])
def test_a_stage_process_without_tensor_work_loads_no_torch(entry: str, kind: str) -> None:
    script = _ACTOR_PROCESS.format(forbidden=NO_TENSOR_WORK, entry=entry, kind=kind)
    assert _steps_loading(script, 2) == [], f"the {kind} process loads these"


# What those stages are built of, and the simulated stages that most integration tests and benches start by the
# hundred (tests/integration/sim_stages.py): each imported alone in a fresh interpreter.
@pytest.mark.parametrize("module", ["actors._stage", "actors.records", "actors.agent.trajectory",
                                    "actors.stages.evaluator_role", "tests.integration.sim_stages"])
def test_a_module_without_tensor_work_loads_no_torch(module: str) -> None:
    script = (f"import json, sys\nimport {module}\n"
              f"print(json.dumps([{module!r}, sorted(m for m in {NO_TENSOR_WORK!r} if m in sys.modules)]))")
    assert _steps_loading(script, 1) == [], f"importing {module} loads these"


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    """The graph finds a planted circle and ignores function-level and TYPE_CHECKING imports."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}}) == [["a"]]
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport runtime.bus\nfrom actors import config\n"
                      "if TYPE_CHECKING:\n    import model.config\n"
                      "try:\n    import nats\nexcept ImportError:\n    pass\n"
                      "def f():\n    import sandbox.tasks\n")
    found = {(i.module, i.at_module_level, i.type_checking) for i in imports_of("actors.m", source, {"actors.config"})}
    assert found == {("runtime.bus", True, False), ("actors.config", True, False), ("model.config", False, True),
                     ("nats", True, False), ("sandbox.tasks", False, False)}
    graph = import_graph()
    assert "runtime.bus" in graph and any(i.module == "nats" for _, _, i in graph["runtime.bus"])
    assert _client_uses(ast.parse("await self.bus.nc.publish(s, b)\nbus.js.publish(s)\nself.nc.flush()")) == [1, 2]
