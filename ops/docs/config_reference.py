"""The configuration reference (docs/reference/configuration.md): every section and key a run file may set.

Generated from the configuration classes, reached as ``--print-config`` reaches them: the default run file
(actors/run.toml) loaded by `runtime.run_config.load_run_config`. Its runtime part is `RuntimeConfig`; its
application part is the ``Config`` its actor classes share (the RL sections of actors/config.py). The run file
names those classes, so ops imports nothing of actors (tests/test_import_graph.py). Each key says its type, its
default (and the default run's value where the run file sets another), its range, whether it is live, and its
comment in the class.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from ops.docs.field_docs import class_docs
from ops.docs.markdown import code, escape, table
from runtime import config as config_mod
from runtime.config import Range
from runtime.run_config import RUNTIME_SECTIONS, ActorSpec, RunConfig, RuntimeConfig, load_run_config

__all__ = ["DEFAULT_RUN_FILE", "KIND", "PAGE", "Key", "Section", "default_run", "documented_keys", "flat_keys",
           "page_key", "render", "sections"]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN_FILE = REPO / "actors" / "run.toml"  # what `python -m actors` runs, and `--print-config` prints
PAGE = "reference/configuration.md"
KIND = "<kind>"  # an actor kind's name in a key: actors.<kind>.count stands for actors.rollout.count and the rest
_UNSET = "unset (left out of `--print-config`)"  # TOML has no null: runtime.run_config.dump_toml drops the key
_KEY_ROW = re.compile(r"^\| `(?P<key>[^`]+\.[^`]+)` \|(?P<rest>.*)$", re.MULTILINE)  # a key's row on the page


@dataclass(frozen=True)
class Key:
    """One key: its dotted name as ``--set`` takes it, and what the class says of it."""

    name: str
    type: str
    default: Any  # the plain value (enums by value, paths as strings); None: unset
    required: bool  # no default: the run file must give it
    range: Range | None
    live: bool
    doc: str


@dataclass(frozen=True)
class Section:
    """One table of the run file (``[bus]``, ``[reconciler.scheduling]``, ``[actors.<kind>]``) and its keys."""

    name: str
    doc: str
    keys: tuple[Key, ...]
    application: bool  # one of the application's sections (its shared Config), not the runtime's


def default_run() -> RunConfig:
    """The default run's resolved configuration, as ``python -m actors --print-config`` resolves it."""
    return load_run_config([DEFAULT_RUN_FILE])


def sections(cfg: RunConfig) -> list[Section]:
    """Every section of ``cfg``'s schema with keys, in the order ``--print-config`` prints them (a section's
    own keys, then its tables, field by field)."""
    found = list(_walk(RuntimeConfig, config_mod.build(RuntimeConfig, {}), "", "", application=False))
    if cfg.app_schema is not None:
        app_default = config_mod.build(cfg.app_schema, {})
        found += _walk(cfg.app_schema, app_default, "", "", application=True)
    return found


def _walk(cls: type, default: Any, prefix: str, holder_doc: str, *, application: bool) -> Iterator[Section]:
    """The sections of ``cls`` under ``prefix``; ``default``: the instance whose values are the defaults (the
    default of the field that holds the section, which may differ from its class's: runtime.config.build), or
    None where there is none (an actor kind's table)."""
    hints = typing.get_type_hints(cls)
    docs = class_docs(cls)
    keys: list[Key] = []
    tables: list[tuple[type, Any, str, str]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        value = getattr(default, f.name) if default is not None else _field_default(f)
        doc = docs.fields.get(f.name, "")
        if _is_section(hint):
            tables.append((hint, value if isinstance(value, hint) else None, f"{prefix}{f.name}.", doc))
        elif typing.get_origin(hint) is dict and _is_section(item := typing.get_args(hint)[1]):
            tables.append((item, None, f"{prefix}{f.name}.{KIND}.", doc))
        else:
            required = value is dataclasses.MISSING
            shown = None if required else config_mod.plain(value)
            keys.append(Key(f"{prefix}{f.name}", type_name(hint), shown, required, f.metadata.get("range"),
                            bool(f.metadata.get("live", False)), doc))
    if keys:
        # The class says what the section is; the comment on the field that holds it, what it is there for
        yield Section(prefix.rstrip("."), "\n\n".join(d for d in (docs.doc, holder_doc) if d), tuple(keys), application)
    for table_cls, table_default, table_prefix, table_doc in tables:
        yield from _walk(table_cls, table_default, table_prefix, table_doc, application=application)


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def type_name(hint: Any) -> str:
    """A type as a run file's author reads it: ``list of float``, ``table of str``, ``int or unset``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or unset" if type(None) in args else "")
    if origin in (tuple, list):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_name(args[1])}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(f'"{m.value}"' for m in hint)
    if hint is Path:
        return "path"
    return hint.__name__ if isinstance(hint, type) else str(hint)


def toml_text(value: Any) -> str:
    """``value`` as a run file writes it (on one line, as ``--set KEY=VALUE`` takes it)."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_text(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).partition(" = ")[2].strip()


def flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of a resolved configuration's tree (an empty table, as a ``table of`` key's
    default, is a value)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def page_key(dotted: str) -> str:
    """The reference's name of a resolved key: an actor kind's name replaced by ``<kind>``."""
    parts = dotted.split(".")
    return ".".join(["actors", KIND, *parts[2:]]) if parts[0] == "actors" and len(parts) > 2 else dotted


def anchor(section: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


def render(cfg: RunConfig | None = None) -> str:
    """The page's text."""
    cfg = cfg or default_run()
    run_values = flat_keys(cfg.to_toml_tree())
    found = sections(cfg)
    app_name = "" if cfg.app_schema is None else f"{cfg.app_schema.__module__}.{cfg.app_schema.__qualname__}"
    out = [
        "# Configuration reference\n",
        "<!-- Generated by `python -m ops.docs` from the configuration classes: edit their comments, not this"
        " page. -->\n",
        "Every key a run file may set, as `python -m actors --print-config` prints the default run "
        f"({code('actors/run.toml')}): a TOML table per section, or `--set section.key=value` on the command "
        "line (the value read as TOML). Keys marked **live** may change while the run goes on "
        "(`python -m ops.config set KEY VALUE`); the others are fixed when it starts. A range `[a, b]` includes "
        "its ends, `(a, b)` leaves them out; a value outside it is refused, naming the key.\n",
        f"The runtime's sections are {code('runtime.run_config.RuntimeConfig')}'s; the others are the RL run's "
        f"({code(app_name)}), which every actor kind of the run shares. `{KIND}` stands for an actor kind's name "
        "(the default run's kinds are [listed below](#the-default-runs-actor-kinds)).\n",
    ]
    for application in (False, True):
        out.append("## The RL run's sections\n" if application else "## The runtime's sections\n")
        for section in (s for s in found if s.application is application):
            out.append(_section(section, run_values))
    out.append(_kinds(cfg))
    return "\n".join(out)


def _section(section: Section, run_values: dict[str, Any]) -> str:
    rows = []
    for key in section.keys:
        rows.append([code(key.name), escape(key.type), _default(key, run_values), code(str(key.range or "")),
                     "live" if key.live else "fixed", escape(key.doc)])
    doc = "".join(f"{escape(paragraph)}\n\n" for paragraph in section.doc.split("\n\n") if paragraph.strip())
    return (f"### {code(f'[{section.name}]')} {{ #{anchor(section.name)} }}\n\n{doc}"
            + table(["Key", "Type", "Default", "Range", "Live", "Description"], rows))


def documented_keys(text: str) -> dict[str, bool]:
    """The keys a configuration reference page lists, each with whether ``--print-config`` prints it (an unset
    key it leaves out)."""
    return {m.group("key"): _UNSET not in m.group("rest") for m in _KEY_ROW.finditer(text)}


def _default(key: Key, run_values: dict[str, Any]) -> str:
    if key.required:
        return "required"
    if key.default is None:
        return _UNSET
    text = code(toml_text(key.default))
    if key.name in run_values and run_values[key.name] != key.default:
        text += f" (default run: {code(toml_text(run_values[key.name]))})"
    return text


def _kinds(cfg: RunConfig) -> str:
    """The default run's actor kinds: each one's entry, and the keys of its table that the run file sets."""
    specs = cfg.runtime.actors
    defaults = {f.name: config_mod.plain(_field_default(f)) for f in dataclasses.fields(ActorSpec)}
    tables = {kind: config_mod.to_dict(spec) for kind, spec in specs.items()}
    columns = [name for name in defaults if any(t[name] != defaults[name] for t in tables.values())]
    rows = [[code(kind), *(code(toml_text(tables[kind][c])) for c in columns)] for kind in specs]
    sections_named = ", ".join(code(s) for s in sorted({k for k in cfg.to_toml_tree() if k not in RUNTIME_SECTIONS}))
    return ("## The default run's actor kinds\n\n"
            f"{code('actors/run.toml')} names these kinds (`[actors.{KIND}]` tables), and through their classes the "
            f"application's sections ({sections_named}); a key not shown has its default.\n\n"
            + table(["Kind", *(code(c) for c in columns)], rows))
