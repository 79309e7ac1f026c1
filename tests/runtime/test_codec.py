from __future__ import annotations

import enum

import msgpack
import msgspec
import pytest

from runtime.codec import Codec, CodecLimits, message
from runtime.errors import MessageError


class Stage(enum.Enum):
    ROLLOUT = "rollout"
    REWARD = "reward"


@message("test.inner")
class Inner:
    tokens: tuple[int, ...]
    score: float


@message("test.outer", version=2)
class Outer:
    sample_id: str
    stage: Stage
    inner: Inner
    tags: dict[str, int]
    note: str | None = None


class MemoryBlob:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    async def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data

    async def get(self, key: str) -> bytes:
        return self.objects[key]


async def test_round_trip_is_typed() -> None:
    codec = Codec([Outer, Inner])
    msg = Outer("s1", Stage.REWARD, Inner((1, 2, 3), 0.5), {"a": 1})
    out = await codec.decode(await codec.encode(msg))
    assert out == msg and isinstance(out.stage, Stage) and isinstance(out.inner.tokens, tuple)


async def test_large_bodies_travel_through_blob_storage() -> None:
    blob = MemoryBlob()
    codec = Codec([Inner], blob=blob, limits=CodecLimits(inline_limit_bytes=1024))
    msg = Inner(tuple(range(5000)), 1.0)
    wire = await codec.encode(msg)
    assert len(wire) < 300 and len(blob.objects) == 1
    assert await codec.decode(wire) == msg


@pytest.mark.parametrize(("wire", "reason"), [
    (b"\xc1", "malformed"),
    (msgpack.packb([1, 2]), "malformed"),
    (msgpack.packb({"schema": 1, "type": "nope", "v": 1, "body": b""}), "unknown_type"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 7, "body": b""}), "version_mismatch"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1,
                    "body": msgpack.packb({"tokens": "x", "score": 1.0})}), "invalid"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1,
                    "body": msgpack.packb({"tokens": [1], "score": 1.0, "extra": 1})}), "invalid"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1, "body": msgpack.packb({"score": 1.0})}),
     "invalid"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1, "blob": f"messages/test.inner/{'0' * 64}"}),
     "blob_missing"),
    # only keys the codec writes are read: no other object of the store, no path out of it
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1, "blob": "gone"}), "invalid_blob_key"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1, "blob": f"../../etc/{'0' * 64}"}), "invalid_blob_key"),
    (msgpack.packb({"schema": 1, "type": "test.inner", "v": 1, "blob": "messages/test.inner/" + "x" * 5000}),
     "invalid_blob_key"),
    (b"\x00" * 2_000_000, "oversized"),
])
async def test_bad_input_is_rejected_with_a_reason(wire: bytes, reason: str) -> None:
    codec = Codec([Inner], blob=MemoryBlob())
    with pytest.raises(MessageError) as err:
        await codec.decode(wire)
    assert err.value.reason == reason


async def test_enum_values_are_validated() -> None:
    codec = Codec([Outer, Inner])
    good = await codec.encode(Outer("s", Stage.ROLLOUT, Inner((), 0.0), {}))
    env = msgpack.unpackb(good)
    body = msgpack.unpackb(env["body"])
    body["stage"] = "training"
    env["body"] = msgpack.packb(body)
    with pytest.raises(MessageError, match="not a Stage"):
        await codec.decode(msgpack.packb(env))


def test_unregistered_type_cannot_be_encoded() -> None:
    codec = Codec([Inner])
    with pytest.raises(TypeError):
        import asyncio

        asyncio.run(codec.encode(Outer("s", Stage.ROLLOUT, Inner((), 0.0), {})))



async def test_any_envelope_fails_as_a_message_error_never_as_a_crash() -> None:
    """Found by the bus fuzz test: a ``type`` that is a map or a list raised TypeError and killed the actor."""
    codec = Codec([Inner])
    for bad_type in ({"a": 1}, [1, 2], 3.5, None, b"test.inner"):
        data = msgpack.packb({"schema": 1, "type": bad_type, "v": 1, "body": b""}, use_bin_type=True)
        with pytest.raises(MessageError) as raised:
            await codec.decode(data)
        assert raised.value.reason == "unknown_type"


async def test_a_blob_body_must_hash_to_its_key() -> None:
    blob = MemoryBlob()
    codec = Codec([Inner], blob=blob, limits=CodecLimits(inline_limit_bytes=1024))
    wire = await codec.encode(Inner(tuple(range(2000)), 1.0))
    (key,) = blob.objects
    blob.objects[key] = msgpack.packb({"tokens": [1], "score": 2.0})  # replaced under the same key
    with pytest.raises(MessageError) as err:
        await codec.decode(wire)
    assert err.value.reason == "invalid" and "hash" in err.value.detail


class Tally(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A msgspec Struct message: the codec takes these as it takes frozen dataclasses."""

    key: str
    counts: tuple[int, ...]
    stage: Stage = Stage.ROLLOUT


async def test_a_msgspec_struct_is_a_message_type_too() -> None:
    codec = Codec({"test.tally": Tally})
    msg = Tally("k", (1, 2), Stage.REWARD)
    assert await codec.decode(await codec.encode(msg)) == msg
    body = msgpack.packb({"key": "k", "counts": [1], "bogus": 1})
    with pytest.raises(MessageError, match=r"unknown field 'bogus'") as err:
        await codec.decode(msgpack.packb({"schema": 1, "type": "test.tally", "v": 1, "body": body}))
    assert err.value.reason == "invalid"

    class Lax(msgspec.Struct, frozen=True):
        key: str

    with pytest.raises(TypeError, match="forbid_unknown_fields"):
        Codec({"test.lax": Lax})


@pytest.mark.parametrize(("body", "said"), [
    ({"tokens": [1, "2"], "score": 1.0}, r"test.inner cannot be a Inner: tokens\[1\]: expected 'int', got 'str'"),
    ({"tokens": [1], "score": True}, r"score: expected 'float', got 'bool'"),
    ({"tokens": [1]}, r"missing required field 'score'"),
])
async def test_a_refused_body_names_the_field_at_fault(body: dict, said: str) -> None:
    wire = msgpack.packb({"schema": 1, "type": "test.inner", "v": 1, "body": msgpack.packb(body)})
    with pytest.raises(MessageError, match=said):
        await Codec([Inner]).decode(wire)


async def test_an_unknown_field_at_any_depth_is_refused_by_name() -> None:
    codec = Codec([Outer, Inner])
    env = msgpack.unpackb(await codec.encode(Outer("s", Stage.ROLLOUT, Inner((1,), 0.5), {"a": 1})))
    body = msgpack.unpackb(env["body"])
    body["inner"]["sneaky"] = [1, 2]
    env["body"] = msgpack.packb(body)
    with pytest.raises(MessageError, match=r"inner: object contains unknown field 'sneaky'"):
        await codec.decode(msgpack.packb(env))

