"""The unknown-field check msgspec lacks for dataclasses: refused at any depth and in any container."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from runtime.validation import did_you_mean, hint_at, split_error, strict_shape, value_at


@dataclass(frozen=True)
class Leaf:
    x: int


@dataclass(frozen=True)
class Tree:
    one: Leaf
    maybe: Leaf | None = None
    many: tuple[Leaf, ...] = ()
    listed: list[Leaf] = field(default_factory=list)
    named: dict[str, Leaf] = field(default_factory=dict)
    plain: dict[str, int] = field(default_factory=dict)


GOOD = {"one": {"x": 1}, "maybe": {"x": 2}, "many": [{"x": 3}], "listed": [{"x": 4}], "named": {"a": {"x": 5}},
        "plain": {"a": 6}}


def _check(tree: dict) -> Tree:
    data = msgspec.msgpack.encode(tree)
    msgspec.msgpack.decode(data, type=strict_shape(Tree))
    return msgspec.msgpack.decode(data, type=Tree)


@pytest.mark.parametrize(("where", "path"), [
    (lambda t: t["one"], "one"), (lambda t: t["maybe"], "maybe"), (lambda t: t["many"][0], "many[0]"),
    (lambda t: t["listed"][0], "listed[0]"), (lambda t: t["named"]["a"], "named[...]"), (lambda t: t, ""),
])
def test_an_unknown_field_is_refused_wherever_it_is(where, path: str) -> None:
    assert _check(GOOD) == Tree(Leaf(1), Leaf(2), (Leaf(3),), [Leaf(4)], {"a": Leaf(5)}, {"a": 6})
    tree = msgspec.msgpack.decode(msgspec.msgpack.encode(GOOD))
    where(tree)["y"] = 0
    with pytest.raises(msgspec.ValidationError) as e:
        _check(tree)
    assert split_error(e.value) == ("object contains unknown field 'y'", path)


def test_a_map_of_plain_values_takes_any_key() -> None:
    assert _check({**GOOD, "plain": {"b": 1, "c": 2}}).plain == {"b": 1, "c": 2}
    assert _check({**GOOD, "maybe": None}).maybe is None


def test_paths_resolve_to_their_type_and_value() -> None:
    assert hint_at(Tree, "many[0].x") is int and hint_at(Tree, "maybe") is Leaf and hint_at(Tree, "nope") is None
    assert value_at(GOOD, "listed[0].x") == 4 and value_at(GOOD, "listed[9].x") is None
    assert did_you_mean("mnay", ["many", "maybe"]) == "; did you mean 'many'?"
    assert did_you_mean("zzz", ["b", "a"]) == "; valid keys here: a, b"
    assert did_you_mean("mnay", ["many", "maybe"], "tree") == "; did you mean 'tree.many'?"
