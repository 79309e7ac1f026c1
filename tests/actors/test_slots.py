"""The slot record: transitions, retries, and its msgpack round trip."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.reconciler.slot import IllegalTransition, Slot, SlotDecodeError, SlotState


def admitted(index: int = 3) -> Slot:
    return Slot.admitted(index, prompt_id="p", epoch=1, position=7, index_in_group=2, trainer_version=5, now=1.0)


def test_admitted_slot_has_deterministic_ids() -> None:
    slot = admitted()
    assert (slot.group_id, slot.sample_id) == ("e1-p7", "e1-p7-s2")
    assert slot.state is SlotState.ROLLOUT and slot.issued_version == 5 and slot.version_floor == 5


def test_full_lifecycle_and_free() -> None:
    slot = admitted()
    for state in (SlotState.REWARD, SlotState.GROUP, SlotState.READY, SlotState.TRAIN):
        slot = slot.moved_to(state, 2.0)
        assert slot.state is state and slot.attempt == 0 and slot.entered_at[state.value] == 2.0
    assert slot.moved_to(SlotState.EMPTY, 3.0) == Slot(index=3)


@pytest.mark.parametrize(
    ("start", "target"),
    [(SlotState.ROLLOUT, SlotState.READY), (SlotState.ROLLOUT, SlotState.ROLLOUT), (SlotState.GROUP, SlotState.FAILED)],
)
def test_illegal_transitions_name_both_states(start: SlotState, target: SlotState) -> None:
    slot = admitted()
    while slot.state is not start:
        slot = slot.moved_to({SlotState.ROLLOUT: SlotState.REWARD, SlotState.REWARD: SlotState.GROUP}[slot.state], 1.0)
    with pytest.raises(IllegalTransition, match=f"{start} → {target}"):
        slot.moved_to(target, 1.0)


def test_retry_bumps_attempt_and_counts_only_when_asked() -> None:
    slot = admitted().retried(2.0, count_retry=False)
    assert (slot.attempt, slot.num_retries) == (1, 0)
    slot = slot.retried(3.0, count_retry=True, attempt=5)
    assert (slot.attempt, slot.num_retries, slot.entered_at["rollout"]) == (5, 1, 3.0)
    with pytest.raises(ValueError, match="must exceed"):
        slot.retried(4.0, count_retry=True, attempt=5)
    with pytest.raises(IllegalTransition):
        Slot(index=0).retried(1.0, count_retry=True)


def test_empty_slot_must_not_hold_a_sample() -> None:
    with pytest.raises(ValueError, match="EMPTY slot holds no sample"):
        Slot(index=0, sample_id="x")
    with pytest.raises(ValueError, match="must hold a sample_id"):
        Slot(index=0, state=SlotState.READY)


@settings(max_examples=50, deadline=None)
@given(
    attempt=st.integers(0, 10**6),
    versions=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).map(sorted),
    keys=st.dictionaries(st.sampled_from(["rollout", "reward", "group"]), st.text(max_size=20)),
    reason=st.text(max_size=30),
)
def test_round_trip(attempt: int, versions: list[int], keys: dict[str, str], reason: str) -> None:
    slot = admitted().moved_to(SlotState.REWARD, 2.5, min_version=versions[0], max_version=versions[1])
    slot = slot.retried(3.0, count_retry=True, attempt=attempt + 1, blob_keys=keys, failure_reason=reason)
    assert Slot.decode(slot.encode()) == slot
    assert Slot.decode(Slot(index=9).encode()) == Slot(index=9)


def test_decode_rejects_other_schema_and_garbage() -> None:
    data = admitted().to_dict()
    data["v"] = 99
    with pytest.raises(SlotDecodeError, match="schema version 99"):
        Slot.decode(msgpack.packb(data))
    with pytest.raises(SlotDecodeError):
        Slot.decode(b"\xc1")
    with pytest.raises(SlotDecodeError, match="map"):
        Slot.decode(msgpack.packb([1, 2]))
