"""Typed, validated configuration from TOML: dataclass defaults, a run file, then ``--set`` overrides.

A configuration schema is a tree of frozen dataclasses. Leaves marked ``live()`` may change while a run
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
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from runtime.errors import ConfigError

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "Range",
    "apply_value",
    "build",
    "check_ranges",
    "field_at",
    "fixed",
    "is_live",
    "live",
    "live_items",
    "load",
    "merge",
    "parse_override",
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
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{left}{lo}, {hi}{right}"

    def check(self, key: str, value: Any) -> None:
        """ConfigError naming ``key`` unless every number in ``value`` (number, list or None) is in range."""
        values = value if isinstance(value, tuple | list) else (value,)
        for v in values:
            if v is not None and not isinstance(v, bool) and v not in self:
                raise ConfigError(f"config key {key!r} = {value!r} is outside its range {self}")


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


def is_live(schema: type, dotted_key: str) -> bool:
    return bool(field_at(schema, dotted_key).metadata.get("live", False))


def field_at(schema: type, dotted_key: str) -> dataclasses.Field[Any]:
    """The dataclass field a dotted key names, or ConfigError naming the key."""
    parts = dotted_key.split(".")
    cls: Any = schema
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise ConfigError(_unknown(".".join(parts[: i + 1]), fields))
        f = fields[part]
        if i == len(parts) - 1:
            return f
        cls = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section")
    raise AssertionError("unreachable")


def _unknown(key: str, fields: Mapping[str, Any]) -> str:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, list(fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys here: {', '.join(sorted(fields))}"
    return f"config key {key!r} is unknown{hint}"


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
    """Validates a nested mapping against a dataclass schema, converting TOML values to field types.

    Keys the mapping leaves out keep their value in ``base`` (default: the schema's field defaults);
    a nested table given in part is merged over the default of the field that holds it.
    """
    if not isinstance(tree, Mapping):
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a table")
    fields = {f.name: f for f in dataclasses.fields(schema)}  # type: ignore[arg-type]
    for key in tree:
        if key not in fields:
            raise ConfigError(_unknown(prefix + key, fields))
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for name, f in fields.items():
        if name in tree:
            default = getattr(base, name) if base is not None else _field_default(f)
            kwargs[name] = _convert(tree[name], hints[name], prefix + name, default)
            if (within := f.metadata.get("range")) is not None:
                within.check(prefix + name, kwargs[name])
    try:
        return schema(**kwargs) if base is None else dataclasses.replace(base, **kwargs)  # type: ignore[type-var]
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'!r}: {e}") from None


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
            items.append((prefix + f.name, _plain(value)))
    return items


def to_dict(config: Any) -> dict[str, Any]:
    """The plain-value tree of a config (enums by value, paths as strings): TOML/msgpack friendly."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        out[f.name] = _plain(getattr(config, f.name))
    return out


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _convert(value: Any, hint: Any, key: str, default: Any = None) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        base = default if isinstance(default, hint) else None  # type: ignore[arg-type]
        return build(hint, value, key + ".", base)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"config key {key!r}: {value!r} matches none of {hint}")
    if origin in (dict, Mapping):
        _, vt = typing.get_args(hint) or (str, Any)
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r} expects a table, got {value!r}")
        return {k: _convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin in (tuple, list):
        args = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key {key!r} expects a list, got {value!r}")
        item = args[0] if args else Any
        items = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in hint)
            raise ConfigError(f"config key {key!r} must be one of {choices}, got {value!r}") from None
    if hint is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"config key {key!r} expects a path string, got {value!r}")
        return Path(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {key!r} = {value!r}: a finite number is required")
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(
                f"config key {key!r} expects {hint.__name__}, got {value!r} ({type(value).__name__})")
        return value
    raise ConfigError(f"config key {key!r} has an unsupported type {hint}")
