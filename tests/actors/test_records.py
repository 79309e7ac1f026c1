"""Stored records are typed on every hop: they round-trip exactly, and a record of another schema or of
the wrong shape is a RecordError naming the record, its type and schema (never a KeyError in a reader)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import msgpack
import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from actors._stage import StageActor, WorkRefused
from actors.agent.trajectory import EpisodeEnd, Segment, ToolUse, Trajectory
from actors.records import (
    RECORD_SCHEMA,
    GroupRecord,
    GroupSample,
    RecordError,
    RewardBreakdown,
    RewardRecord,
    RolloutRecord,
    TestResult,
    decode_record,
    encode_record,
)
from runtime.blob import open_store


def _trajectory(n: int = 6) -> Trajectory:
    return Trajectory([Segment(list(range(n)), [0, 0] + [1] * (n - 2), [0.0] + [-0.5] * (n - 1), [1.0] * n,
                               [-1, -1] + [3] * (n - 2), np.arange(n * 2 * 2, dtype=np.int16).reshape(n, 2, 2),
                               2)],
                      EpisodeEnd.FINAL_ANSWER, [ToolUse("write_file", True, False, 4)], num_turns=2)


_BREAKDOWN = RewardBreakdown(1.0, 2, 2, 10.0, 0.0, 0, 0.0, 1.0)


def _group() -> GroupRecord:
    return GroupRecord("e0-p1", "p1", 3, 3, 1.5, tuple(
        GroupSample(f"e0-p1-s{i}", 1.0, _BREAKDOWN, 0.0, _trajectory()) for i in range(2)))


def _same_trajectory(a: Trajectory, b: Trajectory) -> bool:
    return len(a.segments) == len(b.segments) and all(
        np.array_equal(x.topk_ids_TLK, y.topk_ids_TLK) and {**vars(x), "topk_ids_TLK": None} == {
            **vars(y), "topk_ids_TLK": None} for x, y in zip(a.segments, b.segments, strict=True)) and {
        **vars(a), "segments": None} == {**vars(b), "segments": None}


def test_each_record_round_trips_typed() -> None:
    rollout = RolloutRecord("e0-p1-s0", "p1", _trajectory(), "workspace over its byte budget")
    back = decode_record(encode_record(rollout), RolloutRecord, "samples/e0-p1-s0/a0/trajectory")
    assert isinstance(back.trajectory, Trajectory) and back.trajectory.end is EpisodeEnd.FINAL_ANSWER
    assert back.trajectory.segments[0].topk_ids_TLK.dtype == np.int16
    assert _same_trajectory(back.trajectory, rollout.trajectory)
    assert back.workspace_violation == rollout.workspace_violation and back.schema == RECORD_SCHEMA
    reward = RewardRecord("e0-p1-s0", "p1", "samples/e0-p1-s0/a0", 1.0, _BREAKDOWN,
                          (TestResult("t0", True), TestResult("t1", False)))
    assert decode_record(encode_record(reward), RewardRecord, "r") == reward
    group = decode_record(encode_record(_group()), GroupRecord, "groups/e0-p1/a0")
    assert isinstance(group.samples[1], GroupSample) and isinstance(group.samples[1].components, RewardBreakdown)
    assert all(_same_trajectory(a.trajectory, b.trajectory) for a, b in zip(group.samples, _group().samples,
                                                                            strict=True))


# A rollout record as the code that stored router choices from torch tensors wrote it (schema 3, before the
# records loaded no torch): the layout on the wire is unchanged, byte for byte.
_TORCH_ERA_ROLLOUT = bytes.fromhex(
    "85a973616d706c655f6964a27330a970726f6d70745f6964a27030aa7472616a6563746f72798ca87365676d656e74739188a974"
    "6f6b656e5f696473920708a96c6f73735f6d61736b920001b26265686176696f75725f6c6f6770726f627392cb0000000000000000"
    "cbbfe0000000000000b46c6f6770726f625f74656d70657261747572657392cb3ff0000000000000cb3ff0000000000000a8766572"
    "73696f6e7392ff03ac746f706b5f6964735f544c4b82a5736861706593020102a464617461c4080100ffff02010200aa70726f6d70"
    "745f6c656e01ab73756d6d6172795f6c656e00a3656e64ac66696e616c5f616e73776572a9746f6f6c5f7573657390a96e756d5f74"
    "75726e7300b46e756d5f746f6f6c5f63616c6c5f746f6b656e7300b66e756d5f746f6f6c5f6f75747075745f746f6b656e7300b06e"
    "756d5f66696e616c5f746f6b656e7300b36e756d5f7468696e6b696e675f746f6b656e7300b26e756d5f73756d6d6172795f746f6b"
    "656e7300aa6475726174696f6e5f73cb0000000000000000aa67656e65726174655f73cb0000000000000000a7746f6f6c735f73cb"
    "0000000000000000b3776f726b73706163655f76696f6c6174696f6ea0a6736368656d6103")


def test_router_choices_keep_their_stored_bytes() -> None:
    """Shape and little-endian int16 bytes, as when they were torch tensors: old records read, new ones match."""
    topk = np.array([[[1, -1]], [[258, 2]]], dtype=np.int16)
    record = RolloutRecord("s0", "p0", Trajectory([Segment([7, 8], [0, 1], [0.0, -0.5], [1.0, 1.0], [-1, 3], topk, 1)],
                                                  EpisodeEnd.FINAL_ANSWER))
    assert encode_record(record) == _TORCH_ERA_ROLLOUT
    back = decode_record(_TORCH_ERA_ROLLOUT, RolloutRecord, "k").trajectory.segments[0].topk_ids_TLK
    assert back.dtype == np.int16 and back.flags.writeable and np.array_equal(back, topk)
    assert _tree(record)["trajectory"]["segments"][0]["topk_ids_TLK"] == {"shape": [2, 1, 2],
                                                                          "data": b"\x01\x00\xff\xff\x02\x01\x02\x00"}


def test_router_choices_of_another_dtype_are_not_stored() -> None:
    """A wider array would be cut to int16 unseen: its producer skipped the conversion the episode loop makes."""
    seg = _trajectory().segments[0]
    wider = dataclasses.replace(seg, topk_ids_TLK=seg.topk_ids_TLK.astype(np.int64))
    with pytest.raises(TypeError, match="router choices are stored as int16; got an array of int64"):
        encode_record(RolloutRecord("s0", "p0", Trajectory([wider], EpisodeEnd.FINAL_ANSWER)))


def _tree(record: object) -> dict:
    return msgspec.msgpack.decode(encode_record(record))


def test_records_written_before_the_types_are_refused_naming_record_and_schema() -> None:
    """Schema 1: the untyped maps of before (a trajectory record had no schema field; a group record said 1)."""
    old_rollout = _tree(RolloutRecord("s0", "p1", _trajectory()))
    del old_rollout["schema"]
    with pytest.raises(RecordError, match=r"RolloutRecord 'samples/s0/a0/trajectory' is of schema 1 \(none "
                                          r"written\); this code reads schema 3"):
        decode_record(msgpack.packb(old_rollout), RolloutRecord, "samples/s0/a0/trajectory")
    old_group = {**_tree(_group()), "schema": 1}
    with pytest.raises(RecordError, match=r"GroupRecord 'groups/e0-p1/a0' is of schema 1; this code reads schema 3"):
        decode_record(msgpack.packb(old_group), GroupRecord, "groups/e0-p1/a0")
    newer = {**_tree(_group()), "schema": RECORD_SCHEMA + 1}
    with pytest.raises(RecordError, match=f"is of schema {RECORD_SCHEMA + 1}"):
        decode_record(msgpack.packb(newer), GroupRecord, "groups/e0-p1/a0")


def _broken(change: str) -> bytes:
    tree = _tree(_group())
    sample = tree["samples"][1]
    match change:
        case "missing field":
            del sample["trajectory"]["segments"][0]["versions"]
        case "unknown field":
            sample["trajectory"]["segments"][0]["versoins"] = []
        case "wrong type":
            sample["advantage"] = "high"
        case "wrong enum":
            sample["trajectory"]["end"] = "gave_up"
        case "short array":
            sample["trajectory"]["segments"][0]["topk_ids_TLK"]["data"] = b"\x00" * 3
        case "negative shape":
            sample["trajectory"]["segments"][0]["topk_ids_TLK"]["shape"] = [-1]
        case "array not a map":
            sample["trajectory"]["segments"][0]["topk_ids_TLK"] = [1, 2]
    return msgpack.packb(tree, use_bin_type=True)


_SEG = r"samples\[1\]\.trajectory\.segments\[0\]"


@pytest.mark.parametrize(("change", "said"), [
    ("missing field", _SEG + r" \(sample 'e0-p1-s1'\): object missing required field 'versions'"),
    ("unknown field", _SEG + r" \(sample 'e0-p1-s1'\): object contains unknown field 'versoins'"),
    ("wrong type", r"samples\[1\]\.advantage \(sample 'e0-p1-s1'\): expected 'float', got 'str'"),
    ("wrong enum", r"samples\[1\]\.trajectory\.end \(sample 'e0-p1-s1'\): invalid enum value 'gave_up'"),
    ("short array", _SEG + r"\.topk_ids_TLK \(sample 'e0-p1-s1'\): int16 array of shape \[6, 2, 2\] from 3 bytes"),
    ("negative shape", _SEG + r"\.topk_ids_TLK \(sample 'e0-p1-s1'\): int16 array of shape \[-1\] from 48 bytes"),
    ("array not a map", _SEG + r"\.topk_ids_TLK \(sample 'e0-p1-s1'\)"),
])
def test_a_malformed_record_names_the_record_the_field_and_the_sample(change: str, said: str) -> None:
    with pytest.raises(RecordError, match=r"GroupRecord 'groups/e0-p1/a0' \(schema 3\) is malformed at " + said):
        decode_record(_broken(change), GroupRecord, "groups/e0-p1/a0")


_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=6),
              st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(tree=st.dictionaries(st.sampled_from(["schema", "sample_id", "prompt_id", "trajectory", "samples", "x"]),
                            st.one_of(_values, st.just(RECORD_SCHEMA)), max_size=6),
       cls=st.sampled_from([RolloutRecord, RewardRecord, GroupRecord]))
def test_any_stored_bytes_decode_or_are_a_record_error(tree: dict, cls: type) -> None:
    for data in (msgpack.packb(tree, use_bin_type=True), b"\xc1" + msgpack.packb(tree)):
        try:
            record = decode_record(data, cls, "k")
        except RecordError:
            continue
        assert isinstance(record, cls)


async def test_a_stage_refuses_an_unreadable_record_naming_why(tmp_path: Path) -> None:
    async with open_store(f"file://{tmp_path}") as store:
        stage = SimpleNamespace(ctx=SimpleNamespace(blob=store))
        await StageActor.put_record(stage, "groups/g/a0", _group())  # type: ignore[arg-type]
        assert (await StageActor.get_record(stage, "groups/g/a0", GroupRecord)).group_id == "e0-p1"  # type: ignore[arg-type]
        old = {**_tree(_group()), "schema": 1}
        await store.put("groups/old/a0", zstandard.ZstdCompressor().compress(msgpack.packb(old)))
        with pytest.raises(WorkRefused, match=r"GroupRecord 'groups/old/a0' is of schema 1"):
            await StageActor.get_record(stage, "groups/old/a0", GroupRecord)  # type: ignore[arg-type]
        with pytest.raises(WorkRefused, match=r"RewardRecord 'groups/g/a0' \(schema 3\) is malformed"):
            await StageActor.get_record(stage, "groups/g/a0", RewardRecord)  # type: ignore[arg-type]
