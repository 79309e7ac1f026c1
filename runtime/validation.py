"""What the configuration and the wire codec share of msgspec: its errors said as this project says them,
and the refusal of unknown fields for frozen dataclasses (msgspec refuses them only for its own Structs).

msgspec says ``Expected `int`, got `str` - at `$.rollout.max_tokens```; callers say the key as a user
writes it (``rollout.max_tokens``), what was given and what to do. msgspec ignores unknown fields of a
dataclass; `strict_shape` is a mirror of a dataclass (msgspec Structs with ``forbid_unknown_fields``, leaf
values skipped unparsed) that a payload is first decoded into, so an unknown field at any depth is refused
by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import re
import types
import typing
from collections.abc import Iterable
from typing import Any

import msgspec

__all__ = ["did_you_mean", "enum_choices", "hint_at", "split_error", "strict_shape", "value_at"]

_PART = re.compile(r"\.?([^.\[\]]+)|\[([^\]]*)\]")
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def split_error(error: msgspec.ValidationError) -> tuple[str, str]:
    """(what msgspec found, in lower case with quotes for its backticks; where: ``a.b[0]`` with no ``$.``,
    empty at the root)."""
    m = _AT.match(str(error))
    assert m is not None  # the pattern matches any text
    what = m["what"].replace("`", "'")
    return what[:1].lower() + what[1:], (m["path"] or "").removeprefix(".")


def hint_at(root: Any, path: str) -> Any:
    """The declared type at ``path`` (as `split_error` gives it) under ``root``; None where unknown."""
    hint = root
    for name, _index in _PART.findall(path):
        if name:
            if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
                return None
            hint = typing.get_type_hints(hint).get(name)
        else:  # an item of a list, tuple or dict: its item or value type
            args = [a for a in typing.get_args(hint) if a is not Ellipsis]
            if not args:
                return None
            hint = args[-1]
        hint = _without_none(hint)
    return hint


def value_at(tree: Any, path: str) -> Any:
    """The value at ``path`` in a plain tree of maps and lists; None where there is none."""
    for name, index in _PART.findall(path):
        try:
            tree = tree[name] if name else tree[int(index)]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return tree


def enum_choices(hint: Any) -> str | None:
    """``'a', 'b'`` for an enum type, else None."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ", ".join(repr(m.value) for m in hint)
    return None


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def did_you_mean(name: str, choices: Iterable[str], within: str = "") -> str:
    """``; did you mean 'x'?`` for the nearest choice, else the valid choices.

    ``within``: the dotted section ``name`` is a key of; the suggestion names the key in full
    (``rollout.temperature``), which is what ``--set`` and ``ops.config set`` take, while the nearness is
    judged on the last part alone (a shared prefix would make any key of the section look near)."""
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=1)
    if close:
        key = f"{within}.{close[0]}" if within else close[0]
        return f"; did you mean {key!r}?"
    return f"; valid keys here: {', '.join(choices)}"


def strict_shape(hint: Any) -> Any:
    """The type a payload meant for ``hint`` is checked against first: dataclasses become Structs refusing
    unknown fields, containers of them keep their shape, every other value is skipped unparsed
    (``msgspec.Raw``: the typed pass checks it), so the check costs a walk of the structure only."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_shape(hint)
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if not args or origin is None:
        return msgspec.Raw
    shapes = tuple(a if a is Ellipsis else strict_shape(a) for a in args)
    if all(s is msgspec.Raw or s is Ellipsis for s in shapes):
        return msgspec.Raw
    if origin in (typing.Union, types.UnionType):
        nested = [s for s, a in zip(shapes, args, strict=True) if a is not type(None)]
        # msgspec takes at most one object type in a union; anything else is the typed pass's to refuse
        return nested[0] | None if len(nested) == 1 and type(None) in args else msgspec.Raw
    if origin is dict:  # keys as declared: a Raw key is unhashable
        return dict[args[0], shapes[1]]  # type: ignore[valid-type]
    if origin in (list, tuple):
        return origin[shapes]
    return msgspec.Raw


@functools.cache
def _dataclass_shape(cls: type) -> type[msgspec.Struct]:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, strict_shape(hints[f.name]), None) for f in dataclasses.fields(cls) if f.init]
    return msgspec.defstruct(f"{cls.__name__}Shape", fields, forbid_unknown_fields=True)
