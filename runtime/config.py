"""Typed, validated configuration from TOML: dataclass defaults, a run file, then ``--set`` overrides.

A configuration schema is a tree of frozen dataclasses; msgspec converts the parsed TOML to it (the same
library that decodes wire messages, runtime.codec), and its errors are said here as the key a user writes.
Leaves marked ``live()`` may change while a run
is going (they are kept in the ``config`` KV bucket and watched by actors); every other key is fixed at
start. Errors name the key and the problem, and suggest the nearest valid key.

Every numeric key declares the values it accepts (``live(..., within=Range(...))`` or ``fixed(...)``);
a value outside, or a float that is not finite, is refused at load and when changed live, with an
error naming the key, its range and the value. A table given in part (``--set
reconciler.scheduling.eta=2``) is merged over the default of the field that holds it, not over the
defaults of its class: the field's default may differ from its class's (a section that needs 64
rollouts in flight where the class says 8).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import tomli_w

from runtime.errors import ConfigError
from runtime.validation import did_you_mean, enum_choices, hint_at, split_error, value_at

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "Range",
    "apply_value",
    "build",
    "check_ranges",
    "field_at",
    "field_is_live",
    "fixed",
    "is_live",
    "key_note",
    "live",
    "live_items",
    "load",
    "merge",
    "parse_override",
    "plain",
    "read_files",
    "set_path",
    "to_dict",
]


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a key accepts: from ``lo`` to ``hi`` (None: unbounded), each end included unless open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else _exact(self.lo)
        hi = "inf" if self.hi is None else _exact(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{left}{lo}, {hi}{right}"

    def check(self, key: str, value: Any) -> None:
        """ConfigError naming ``key`` unless every number in ``value`` (number, list or None) is in range."""
        values = value if isinstance(value, tuple | list) else (value,)
        for v in values:
            if v is not None and not isinstance(v, bool) and v not in self:
                raise ConfigError(f"config key {key!r} = {value!r} is outside its range {self}")


def _exact(bound: float) -> str:
    """A range's end as written: whole numbers in full (2**63 - 1, not 9.22337e+18), others shortest."""
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


def check_ranges(config: Any, section: str) -> None:
    """ConfigError unless every field of ``config`` with a declared range holds a value in it.

    For ``__post_init__``: a section built in code is checked as one loaded from TOML is (where
    `build` has already checked each key under its full dotted name)."""
    for f in dataclasses.fields(config):
        if (within := f.metadata.get("range")) is not None:
            within.check(f"{section}.{f.name}", getattr(config, f.name))


def live(default: Any, *, within: Range | None = None, **kwargs: Any) -> Any:
    """A dataclass field that operators may change while the run goes on (numbers: with their range)."""
    return dataclasses.field(default=default, metadata={"live": True, "range": within}, **kwargs)


def fixed(default: Any, *, within: Range, **kwargs: Any) -> Any:
    """A numeric dataclass field fixed at start, with the values it accepts."""
    return dataclasses.field(default=default, metadata={"range": within}, **kwargs)


LIVE = "live"  # key_note's mark of a live key


def is_live(schema: type, dotted_key: str) -> bool:
    return field_is_live(field_at(schema, dotted_key))


def field_is_live(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("live", False))


def key_note(f: dataclasses.Field[Any]) -> str:
    """What a key's field says of it beyond its value: ``live`` (it may change while a run goes on) and the
    values it accepts (``[0, 4]``), e.g. ``live, [0, 4]``; "" for a fixed key without a range."""
    within = f.metadata.get("range")
    return ", ".join(([LIVE] if field_is_live(f) else []) + ([str(within)] if within else []))


def field_at(schema: type, dotted_key: str) -> dataclasses.Field[Any]:
    """The dataclass field a dotted key names, or ConfigError naming the key (and the nearest valid one).

    A table of sections (``actors: dict[str, ActorSpec]``) takes any name as its next part: ``actors.rollout.count``
    is ActorSpec's ``count``."""
    parts = dotted_key.split(".")
    cls: Any = schema
    i = 0
    while True:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        part = parts[i]
        if part not in fields:
            if mended := _mended(cls, part, parts[i + 1:]):
                full = ".".join([*parts[:i], mended])
                raise ConfigError(f"config key {dotted_key!r} is unknown; did you mean {full!r}?")
            raise ConfigError(_unknown(".".join(parts[: i + 1]), fields))
        f = fields[part]
        if i == len(parts) - 1:
            return f
        hint = typing.get_type_hints(cls)[part]
        if typing.get_origin(hint) is dict and _is_section(typing.get_args(hint)[-1]):
            if i + 1 == len(parts) - 1:  # names one table of the map (actors.rollout): its field is the map's
                return f
            hint, i = typing.get_args(hint)[-1], i + 1
        if not dataclasses.is_dataclass(hint):
            raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section")
        cls, i = hint, i + 1


def _mended(cls: Any, part: str, rest: list[str]) -> str:
    """``part.<rest>`` with ``part`` replaced by a near field of ``cls`` under which ``rest`` is a valid key (a
    mistyped section: ``rolout.temperature`` is ``rollout.temperature``), else ""."""
    if not rest:
        return ""
    for name in difflib.get_close_matches(part, [f.name for f in dataclasses.fields(cls)], n=3):
        try:
            field_at(cls, ".".join([name, *rest]))
        except ConfigError:
            continue
        return ".".join([name, *rest])
    return ""


def _unknown(key: str, fields: Mapping[str, Any]) -> str:
    """``key`` is unknown, with the nearest key of its section named in full (what ``--set`` and ``ops.config
    set`` take: ``rollout.temperature``, not ``temperature``)."""
    within, _, name = key.rpartition(".")
    return f"config key {key!r} is unknown{did_you_mean(name, fields, within)}"


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=VALUE``: VALUE is read as a TOML value (``0.7``, ``true``, ``[1, 2]``), else as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    return key, _toml_value(raw.strip())


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def set_path(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {key!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def read_files(files: Iterable[Path]) -> dict[str, Any]:
    """TOML files merged in order (later files win, tables merge key by key)."""
    tree: dict[str, Any] = {}
    for path in files:
        try:
            with open(path, "rb") as fh:
                tree = merge(tree, tomllib.load(fh))
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    return tree


def load(schema: type[T], files: Iterable[Path] = (), overrides: Iterable[str] = ()) -> T:
    """Builds ``schema`` from its defaults, then each TOML file in order, then ``key=value`` overrides."""
    tree = read_files(files)
    for text in overrides:
        key, value = parse_override(text)
        field_at(schema, key)  # unknown keys fail here, with a suggestion
        set_path(tree, key, value)
    return build(schema, tree)


def build(schema: type[T], tree: Mapping[str, Any], prefix: str = "", base: T | None = None) -> T:
    """Validates a nested mapping against a dataclass schema (msgspec converts each section to its type).

    Keys the mapping leaves out keep their value in ``base`` (default: the schema's field defaults);
    a nested table given in part is merged over the default of the field that holds it. Each section
    is converted on its own, so an error names its key in full (``actors.rollout.count``, where
    msgspec alone says ``$.actors[...].count``), and a section's own check names the section.
    """
    if not isinstance(tree, Mapping):
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a table, got {tree!r}")
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}  # type: ignore[arg-type]
    for key in tree:
        if key not in fields:
            raise ConfigError(_unknown(prefix + key, fields))
    hints = typing.get_type_hints(schema)
    section: dict[str, Any] = {}
    for name, f in fields.items():
        key, hint = prefix + name, hints[name]
        if name not in tree:
            if base is not None:
                section[name] = getattr(base, name)
            continue
        value = tree[name]
        if _is_section(hint):
            default = getattr(base, name) if base is not None else _field_default(f)
            value = build(hint, value, key + ".", default if isinstance(default, hint) else None)
        elif _is_section(item := typing.get_args(hint)[-1] if typing.get_origin(hint) is dict else None) \
                and isinstance(value, Mapping):
            value = {k: build(item, v, f"{key}.{k}.") for k, v in value.items()}
        else:
            _check_number(key, value, hint, f.metadata.get("range"))
        section[name] = value
    try:
        return msgspec.convert(section, schema, dec_hook=_decode_path)
    except msgspec.ValidationError as e:
        raise ConfigError(_say(e, schema, section, prefix)) from None


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _check_number(key: str, value: Any, hint: Any, within: Range | None) -> None:
    """ConfigError naming ``key`` for a non-finite float or a number outside ``within``; a value of the
    wrong type is left to the section's conversion, which says so."""
    try:
        typed = msgspec.convert(value, hint, dec_hook=_decode_path)
    except msgspec.ValidationError:
        return
    for v in typed if isinstance(typed, tuple | list) else (typed,):
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"config key {key!r} = {typed!r}: a finite number is required")
    if within is not None:
        within.check(key, typed)


def _decode_path(hint: Any, value: Any) -> Any:
    if hint is Path and isinstance(value, str | Path):
        return Path(value)
    raise TypeError(f"Expected `{'path string' if hint is Path else hint}`, got `{type(value).__name__}`")


def _say(error: msgspec.ValidationError, schema: type, section: Mapping[str, Any], prefix: str) -> str:
    """msgspec's error said as a user writes the key: what it expects, what it got, and what to write."""
    what, path = split_error(error)
    if what.startswith("object missing required field"):
        missing = ".".join(p for p in (prefix.rstrip("."), path, what.rsplit(" ", 1)[-1].strip("'")) if p)
        return f"config key {missing!r} is required: it has no default"
    if not path:  # the section's own __post_init__ refused it
        return f"config section {prefix.rstrip('.') or '<root>'!r}: {what}"
    key, hint = prefix + path, hint_at(schema, path)
    if "[...]" in path:  # a value of a table of values: msgspec does not say which key holds it
        return f"config key {key!r}: {what}"
    given = value_at(section, path)
    if (choices := enum_choices(hint)) is not None:
        return f"config key {key!r} must be one of {choices}, got {given!r}"
    if what.startswith("expected"):
        return f"config key {key!r} expects {_type_name(hint)}, got {given!r} ({type(given).__name__})" + (
            _example(schema, path, key))
    return f"config key {key!r}: {what}"


def _example(schema: type, path: str, key: str) -> str:
    """``; e.g. key=<default>`` for a key of ``schema`` itself whose default TOML can write."""
    f = next((f for f in dataclasses.fields(schema) if f.name == path), None)  # type: ignore[arg-type]
    default = None if f is None else plain(_field_default(f))
    if not isinstance(default, str | int | float | bool | list):
        return ""
    return f"; e.g. {key}={tomli_w.dumps({'v': default}).removeprefix('v = ').strip()} (its default)"


def _type_name(hint: Any) -> str:
    if hint is Path:
        return "a path string"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "") if hint is not None else "another type"


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def apply_value(config: T, dotted_key: str, value: Any) -> T:
    """A copy of ``config`` with one key changed, validated exactly as at load time."""
    tree = to_dict(config)
    set_path(tree, dotted_key, value)
    return build(type(config), tree)


def live_items(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, plain value) of every live leaf of a config object."""
    items: list[tuple[str, Any]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            items += live_items(value, f"{prefix}{f.name}.")
        elif f.metadata.get("live", False):
            items.append((prefix + f.name, plain(value)))
    return items


def to_dict(config: Any) -> dict[str, Any]:
    """The plain-value tree of a config (enums by value, paths as strings): TOML/msgpack friendly."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        out[f.name] = plain(getattr(config, f.name))
    return out


def plain(v: Any) -> Any:
    """``v`` as TOML holds it (and ``--print-config`` prints it): enums by value, paths as strings."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple | list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v
