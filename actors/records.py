"""The records a sample's path leaves in blob storage, typed on every hop: what the rollout writes and the
reward actor reads, what the reward actor writes and grouping reads, what grouping writes and the trainer
reads. Stage actors keep them zstd-compressed (actors._stage); this module is their msgpack form.

    samples/<sample>/a<n>/trajectory        RolloutRecord  (rollout -> reward, grouping)
    samples/<sample>/a<n>/reward-a<m>       RewardRecord   (reward -> grouping)
    groups/<group>/a<n>                     GroupRecord    (grouping -> trainer; its samples are GroupSamples)
    samples/<sample>/trainer-logprobs       TrainerLogprobs (trainer -> the dashboard's rollout viewer)

Every record carries ``schema``: the layout this code reads (`RECORD_SCHEMA`). A record of another
schema (schema 1 was the untyped maps written before these types: trajectory records had no schema
field at all; schema 2 had one flat token list per trajectory, schema 3 a chain of segments, each with its
tokens, loss mask, behaviour log-probs, temperatures, versions and router choices), or one that does not
decode as its type, is a `RecordError` naming the record's key,
type, schema and the field at fault: never a KeyError deep inside a reader.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np

from actors.agent.trajectory import Trajectory
from runtime.validation import split_error, strict_shape, value_at

__all__ = [
    "RECORD_SCHEMA",
    "GroupRecord",
    "GroupSample",
    "RecordError",
    "RewardBreakdown",
    "RewardRecord",
    "RolloutRecord",
    "TestResult",
    "TrainerLogprobs",
    "decode_record",
    "encode_record",
    "trainer_logprobs_key",
]

RECORD_SCHEMA = 3
R = TypeVar("R")


class RecordError(ValueError):
    """A stored record that this code cannot read: another schema, or not its type."""


@dataclass(frozen=True)
class RolloutRecord:
    """One rollout attempt's episode; ``workspace_violation`` says why its workspace was not kept (empty: kept)."""

    sample_id: str
    prompt_id: str
    trajectory: Trajectory
    workspace_violation: str = ""
    schema: int = RECORD_SCHEMA


@dataclass(frozen=True)
class RewardBreakdown:
    pass_fraction: float
    num_passed: int
    num_tests: int
    weighted_length: float
    length_penalty: float
    num_malformed_calls: int
    malformed_penalty: float
    reward: float


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # a record, not a pytest test class

    name: str
    passed: bool


@dataclass(frozen=True)
class RewardRecord:
    sample_id: str
    prompt_id: str
    rollout_key: str
    reward: float
    components: RewardBreakdown
    tests: tuple[TestResult, ...]
    schema: int = RECORD_SCHEMA


@dataclass(frozen=True)
class GroupSample:
    """One sample of a group as the trainer takes it: its episode, reward and advantage."""

    sample_id: str
    reward: float
    components: RewardBreakdown
    advantage: float
    trajectory: Trajectory
    tests: tuple[TestResult, ...] = ()  # the hidden tests, as the reward actor ran them (for people: the viewer)


@dataclass(frozen=True)
class GroupRecord:
    """A prompt's G rewarded samples, ready to train, tagged with the policy versions their tokens came from."""

    group_id: str
    prompt_id: str
    min_version: int
    max_version: int
    created_at: float
    samples: tuple[GroupSample, ...]
    schema: int = RECORD_SCHEMA


@dataclass(frozen=True)
class TrainerLogprobs:
    """What the trainer's forward scored a trained sample's tokens at, for people (the rollout viewer): per
    segment of its chain, one float32 (little-endian bytes) per token, the new policy's log-prob of that token
    exactly as the loss took it; NaN where the loss mask is 0 and at a segment's first token (nothing predicts
    it). ``version``: the policy version that computed them (its step made ``version + 1``)."""

    sample_id: str
    version: int
    segments: tuple[bytes, ...]
    schema: int = RECORD_SCHEMA


def trainer_logprobs_key(sample_id: str) -> str:
    """Where a sample's `TrainerLogprobs` are stored: beside its other blobs, so they are collected with its
    group (actors.blob_collector) and a long run's storage stays bounded."""
    return f"samples/{sample_id}/trainer-logprobs"


@dataclass(frozen=True)
class _RouterChoicesWire:
    """Router choices (`actors.agent.trajectory.Segment.topk_ids_TLK`) on the wire: their shape and their
    int16 values as little-endian bytes, row-major. Schema 3 wrote them from torch tensors; the bytes are
    the same."""

    shape: tuple[int, ...]
    data: bytes


_WIRE_INT16 = np.dtype("<i2")


def _encode_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype != np.int16:  # a wider type would be cut silently: the producer is wrong
            raise TypeError(f"router choices are stored as int16; got an array of {obj.dtype}")
        return _RouterChoicesWire(tuple(int(d) for d in obj.shape), obj.astype(_WIRE_INT16, copy=False).tobytes())
    raise NotImplementedError(f"{type(obj).__name__} has no record form")


def _decode_array(hint: Any, obj: Any) -> Any:
    if hint is np.ndarray:
        try:
            wire = msgspec.convert(obj, _RouterChoicesWire)
        except msgspec.ValidationError as e:  # said again as a TypeError: msgspec then adds the path
            raise TypeError(f"int16 array as {{shape, data}}: {e}") from None
        shape = list(wire.shape)
        if any(d < 0 for d in shape) or 2 * math.prod(shape) != len(wire.data):
            raise ValueError(f"int16 array of shape {shape} from {len(wire.data)} bytes: needs "
                             f"{2 * math.prod(shape)} bytes and no negative dimension")
        # astype copies into a writable array of the machine's int16 (torch.from_numpy takes no other)
        return np.frombuffer(wire.data, dtype=_WIRE_INT16).astype(np.int16).reshape(shape)
    raise NotImplementedError(f"{hint} has no record form")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_array)


class _Head(msgspec.Struct):
    schema: Any = None


_HEAD = msgspec.msgpack.Decoder(_Head)


@functools.cache
def _decoders(cls: type) -> tuple[msgspec.msgpack.Decoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Decoder(strict_shape(cls)), msgspec.msgpack.Decoder(cls, dec_hook=_decode_array)


def encode_record(record: Any) -> bytes:
    """The msgpack form of a record (router choices as shape and int16 bytes)."""
    return _ENCODER.encode(record)


def decode_record(data: bytes, cls: type[R], key: str) -> R:
    """The record of type ``cls`` stored at ``key``.

    Raises:
        RecordError: naming ``key``, the type and the schema: a record of another schema, one that is not
            msgpack, or one that is not a ``cls`` (the field at fault, and the sample it belongs to).
    """
    what = f"{cls.__name__} {key!r}"
    try:
        schema = _HEAD.decode(data).schema
    except msgspec.DecodeError as e:
        raise RecordError(f"{what} is not a record: {e}") from None
    if schema != RECORD_SCHEMA:
        raise RecordError(f"{what} is of schema {schema if schema is not None else '1 (none written)'}; this "
                          f"code reads schema {RECORD_SCHEMA}: it was written by another version of the code")
    shape, typed = _decoders(cls)
    try:
        shape.decode(data)
        return typed.decode(data)
    except msgspec.ValidationError as e:
        found, path = split_error(e)
        raise RecordError(f"{what} (schema {schema}) is malformed at {path or 'its root'}"
                          f"{_owner(data, path)}: {found}") from None


def _owner(data: bytes, path: str) -> str:
    """`` (sample 's1')``: the innermost sample or group along ``path``, to find the record's producer."""
    tree = msgspec.msgpack.decode(data)
    parts = path.split(".")
    for depth in range(len(parts), -1, -1):
        node = value_at(tree, ".".join(parts[:depth]))
        if isinstance(node, dict):
            for field in ("sample_id", "group_id"):
                if isinstance(node.get(field), str):
                    return f" ({field.removesuffix('_id')} {node[field]!r})"
    return ""

