"""Stored records are typed on every hop: they round-trip exactly, and a record of another schema or of
the wrong shape is a RecordError naming the record, its type and schema (never a KeyError in a reader)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgpack
import msgspec
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from actors._stage import StageActor, WorkRefused
from actors.agent.episode import EpisodeEnd, Segment, ToolUse, Trajectory
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
                               [-1, -1] + [3] * (n - 2), torch.arange(n * 2 * 2, dtype=torch.int16).reshape(n, 2, 2),
                               2)],
                      EpisodeEnd.FINAL_ANSWER, [ToolUse("write_file", True, False, 4)], num_turns=2)


_BREAKDOWN = RewardBreakdown(1.0, 2, 2, 10.0, 0.0, 0, 0.0, 1.0)


def _group() -> GroupRecord:
    return GroupRecord("e0-p1", "p1", 3, 3, 1.5, tuple(
        GroupSample(f"e0-p1-s{i}", 1.0, _BREAKDOWN, 0.0, _trajectory()) for i in range(2)))


def _same_trajectory(a: Trajectory, b: Trajectory) -> bool:
    return len(a.segments) == len(b.segments) and all(
        torch.equal(x.topk_ids_TLK, y.topk_ids_TLK) and {**vars(x), "topk_ids_TLK": None} == {
            **vars(y), "topk_ids_TLK": None} for x, y in zip(a.segments, b.segments, strict=True)) and {
        **vars(a), "segments": None} == {**vars(b), "segments": None}


def test_each_record_round_trips_typed() -> None:
    rollout = RolloutRecord("e0-p1-s0", "p1", _trajectory(), "workspace over its byte budget")
    back = decode_record(encode_record(rollout), RolloutRecord, "samples/e0-p1-s0/a0/trajectory")
    assert isinstance(back.trajectory, Trajectory) and back.trajectory.end is EpisodeEnd.FINAL_ANSWER
    assert back.trajectory.segments[0].topk_ids_TLK.dtype == torch.int16
    assert _same_trajectory(back.trajectory, rollout.trajectory)
    assert back.workspace_violation == rollout.workspace_violation and back.schema == RECORD_SCHEMA
    reward = RewardRecord("e0-p1-s0", "p1", "samples/e0-p1-s0/a0", 1.0, _BREAKDOWN,
                          (TestResult("t0", True), TestResult("t1", False)))
    assert decode_record(encode_record(reward), RewardRecord, "r") == reward
    group = decode_record(encode_record(_group()), GroupRecord, "groups/e0-p1/a0")
    assert isinstance(group.samples[1], GroupSample) and isinstance(group.samples[1].components, RewardBreakdown)
    assert all(_same_trajectory(a.trajectory, b.trajectory) for a, b in zip(group.samples, _group().samples,
                                                                            strict=True))


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
        case "short tensor":
            sample["trajectory"]["segments"][0]["topk_ids_TLK"]["data"] = b"\x00" * 3
        case "tensor not a map":
            sample["trajectory"]["segments"][0]["topk_ids_TLK"] = [1, 2]
    return msgpack.packb(tree, use_bin_type=True)


_SEG = r"samples\[1\]\.trajectory\.segments\[0\]"


@pytest.mark.parametrize(("change", "said"), [
    ("missing field", _SEG + r" \(sample 'e0-p1-s1'\): object missing required field 'versions'"),
    ("unknown field", _SEG + r" \(sample 'e0-p1-s1'\): object contains unknown field 'versoins'"),
    ("wrong type", r"samples\[1\]\.advantage \(sample 'e0-p1-s1'\): expected 'float', got 'str'"),
    ("wrong enum", r"samples\[1\]\.trajectory\.end \(sample 'e0-p1-s1'\): invalid enum value 'gave_up'"),
    ("short tensor", _SEG + r"\.topk_ids_TLK \(sample 'e0-p1-s1'\): int16 tensor of shape"),
    ("tensor not a map", _SEG + r"\.topk_ids_TLK \(sample 'e0-p1-s1'\)"),
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
