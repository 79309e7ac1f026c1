"""runtime.kv_watch: what a stored record is to a watcher, and how a watch tells a lost change from an old one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime.kv_watch import Admission, KVEntry, WatchCursor, entry_of, subject_matches


def test_a_record_is_a_value_a_delete_or_a_purge_by_its_headers() -> None:
    assert entry_of("k", b"v", 3, {}) == KVEntry("k", b"v", 3)
    assert entry_of("k", b"", 4, {"KV-Operation": "DEL"}) == KVEntry("k", b"", 4, deleted=True)
    assert entry_of("k", b"", 5, {"KV-Operation": "PURGE", "Nats-Rollup": "sub"}) == \
        KVEntry("k", b"", 5, deleted=True, purged=True)
    # the markers the server places (nats-server >= 2.11): a TTL or max age that ran out is a purge
    assert entry_of("k", b"", 6, {"Nats-Marker-Reason": "MaxAge", "Nats-TTL": "60s"}) == \
        KVEntry("k", b"", 6, deleted=True, purged=True)
    assert entry_of("k", b"", 7, {"Nats-Marker-Reason": "Remove"}) == KVEntry("k", b"", 7, deleted=True)
    assert entry_of("k", b"", 8, {"Nats-Marker-Reason": "Something-New"}) is None  # no value either: skipped


def test_subjects_match_nats_wildcards() -> None:
    assert subject_matches(">", "a") and subject_matches(">", "a.b")
    assert subject_matches("reg.reconciler.*", "reg.reconciler.r-1")
    assert not subject_matches("reg.reconciler.*", "reg.x.r")
    assert not subject_matches("reg.reconciler.*", "reg.reconciler.r.1")
    assert subject_matches("reg.>", "reg.a.b") and not subject_matches("reg.>", "reg")
    assert subject_matches("handover.trainer.rendezvous", "handover.trainer.rendezvous")
    assert not subject_matches("handover.trainer", "handover.trainer.rendezvous")


def test_a_record_before_the_cut_is_old_and_one_after_a_lost_one_is_a_gap() -> None:
    cursor = WatchCursor(sequence=10)
    assert cursor.admit(9) is Admission.OLD  # came between subscribing and reading
    assert cursor.admit(10) is Admission.OLD
    assert cursor.admit(11) is Admission.NEW
    assert cursor.admit(12) is Admission.NEW
    assert cursor.admit(14) is Admission.GAP  # 13 never came
    assert cursor.sequence == 12


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, int, int, set[int]]:
    """How many records the stream stores (sequences 1..n), the sequence it was read at, the first sequence
    the subscription got (at most the cut + 1: it was made before the read), and the sequences lost on the way."""
    n = draw(st.integers(1, 60))
    cut = draw(st.integers(0, n))
    subscribed = draw(st.integers(1, cut + 1))
    lost = draw(st.sets(st.integers(1, n), max_size=3))  # one before the subscription: never sent to it anyway
    return n, cut, subscribed, lost


@given(histories())
def test_a_reader_takes_every_record_after_the_cut_once_in_order_and_notices_a_lost_one(
        history: tuple[int, int, int, set[int]]) -> None:
    n, cut, subscribed, lost = history
    cursor = WatchCursor(cut)
    taken, gap_at = [], None
    for sequence in range(subscribed, n + 1):
        if sequence in lost:
            continue
        admission = cursor.admit(sequence)
        if admission is Admission.GAP:
            gap_at = sequence
            break
        if admission is Admission.NEW:
            taken.append(sequence)
    lost_after_cut = sorted(s for s in lost if s > cut)
    received_after = [s for s in range(lost_after_cut[0] + 1, n + 1) if s not in lost] if lost_after_cut else []
    if received_after:  # noticed at the first record received after the first one lost
        assert gap_at == received_after[0]
        assert taken == list(range(cut + 1, lost_after_cut[0]))
    else:  # nothing lost after the cut, or nothing received after the loss (noticed at the stream's next record)
        assert gap_at is None
        assert taken == list(range(cut + 1, lost_after_cut[0] if lost_after_cut else n + 1))
