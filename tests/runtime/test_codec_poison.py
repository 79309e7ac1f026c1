"""Any envelope that does not decode is a MessageError (a dead letter), whatever found the fault;
only a blob store outage stays an OSError (retried: not the message's fault)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.blob import open_store
from runtime.codec import Codec, message
from runtime.errors import MessageError


@message("poison.item")
class Item:
    key: str
    count: int
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count={self.count} must be >= 0")


@dataclasses.dataclass(frozen=True)
class Picky:
    """A wire type whose own check raises something other than TypeError/ValueError."""

    key: str

    def __post_init__(self) -> None:
        if self.key == "boom":
            raise LookupError("no such key in the catalogue")


def _env(**fields: object) -> bytes:
    return msgpack.packb({"schema": 1, "v": 1, **fields}, use_bin_type=True)


_BODY = msgpack.packb({"key": "k", "count": 1}, use_bin_type=True)


@pytest.mark.parametrize(("wire", "reason"), [
    (_env(type=["poison.item"], body=_BODY), "unknown_type"),  # unhashable: TypeError in a dict lookup
    (_env(type={"a": 1}, body=_BODY), "unknown_type"),
    (_env(type="poison.item", blob="../../x"), "invalid_blob_key"),  # ValueError from validate_key
    (_env(type="poison.item", blob="/etc/passwd"), "invalid_blob_key"),
    (_env(type="poison.item", blob=".tmp/x"), "invalid_blob_key"),
    (_env(type="poison.item", blob=""), "invalid_blob_key"),
    (_env(type="picky", body=msgpack.packb({"key": "boom"})), "malformed"),  # LookupError from the type
])
async def test_poison_envelopes_are_message_errors(tmp_path: Path, wire: bytes, reason: str) -> None:
    codec = Codec({"poison.item": Item, "picky": Picky}, blob=open_store((tmp_path / "blobs").as_uri()))
    with pytest.raises(MessageError) as err:
        await codec.decode(wire)
    assert err.value.reason == reason


async def test_a_storage_outage_is_not_a_poison_message(tmp_path: Path) -> None:
    class Down:
        async def put(self, key: str, data: bytes) -> None:
            raise ConnectionError("store down")

        async def get(self, key: str) -> bytes:
            raise ConnectionError("store down")

    with pytest.raises(ConnectionError):
        # a key of the codec's own shape (messages/<type>/<sha256>): only the store's answer is wrong
        await Codec([Item], blob=Down()).decode(_env(type="poison.item", blob=f"messages/poison.item/{'0' * 64}"))


_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8,
)
_fields = st.fixed_dictionaries({}, optional={"key": _values, "count": _values, "weights": _values,
                                              "extra": _values})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(type_=st.one_of(_values, st.just("poison.item")), v=st.one_of(_values, st.just(1)),
       fields=_fields, blob=st.one_of(st.none(), st.text(max_size=12)))
async def test_any_envelope_decodes_or_is_a_message_error(
        tmp_path: Path, type_: object, v: object, fields: dict, blob: str | None) -> None:
    env: dict[str, object] = {"schema": 1, "type": type_, "v": v}
    if blob is None:
        env["body"] = msgpack.packb(fields, use_bin_type=True)
    else:
        env["blob"] = blob
    codec = Codec([Item], blob=open_store((tmp_path / "blobs").as_uri()))
    try:
        msg = await codec.decode(msgpack.packb(env, use_bin_type=True))
    except MessageError:
        return
    assert isinstance(msg, Item)
