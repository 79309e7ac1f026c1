"""runtime.kv_watch: what a stored record is to a watcher, and how a watch tells a lost change from an old one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime.kv_watch import Admission, KVEntry, WatchCursor, entry_of


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


def test_a_record_before_the_cut_is_old_and_one_after_a_lost_one_is_a_gap() -> None:
    cursor = WatchCursor(snapshot_sequence=10)
    assert cursor.admit("a", 9, 2) is Admission.OLD  # came between subscribing and the snapshot
    assert cursor.admit("a", 11, 9) is Admission.NEW  # its previous record is in the snapshot
    assert cursor.admit("a", 12, 11) is Admission.NEW
    assert cursor.admit("b", 13, 0) is Admission.NEW  # a new key
    assert cursor.admit("a", 15, 14) is Admission.GAP  # a's record at 14 never came


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[str], int, int, set[int]]:
    """Writes (the key of each; its sequence is its index + 1), the sequence the snapshot was read at, the
    first sequence the subscription got (at most the cut + 1), and the sequences lost on the way."""
    keys = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=40))
    cut = draw(st.integers(0, len(keys)))
    subscribed = draw(st.integers(1, cut + 1))
    lost = draw(st.sets(st.integers(1, len(keys)), max_size=3))  # one before the subscription: never sent to it
    return keys, cut, subscribed, lost


@given(histories())
def test_a_watch_admits_every_record_after_the_cut_once_and_notices_a_lost_one(
        history: tuple[list[str], int, int, set[int]]) -> None:
    keys, cut, subscribed, lost = history
    previous: dict[str, int] = {}
    records = []  # (key, sequence, the key's previous sequence): what the stream republishes
    for sequence, key in enumerate(keys, start=1):
        records.append((key, sequence, previous.get(key, 0)))
        previous[key] = sequence
    cursor = WatchCursor(cut)
    admitted, gap_at = [], None
    for key, sequence, before in records[subscribed - 1 :]:
        if sequence in lost:
            continue
        admission = cursor.admit(key, sequence, before)
        if admission is Admission.GAP:
            gap_at = sequence
            break
        if admission is Admission.NEW:
            admitted.append(sequence)
    lost_after_cut = {s for s in lost if s > cut}
    # a lost record is noticed by the next record of its key that comes, if one does
    noticeable = [next((s for s in range(n + 1, len(keys) + 1) if keys[s - 1] == keys[n - 1] and s not in lost), None)
                  for n in lost_after_cut]
    noticeable = [s for s in noticeable if s is not None]
    if not noticeable:
        assert gap_at is None
        assert admitted == [s for s in range(cut + 1, len(keys) + 1) if s not in lost]  # each once, in order
    else:
        assert gap_at is not None and gap_at <= min(noticeable)
        assert all(s > cut and s not in lost for s in admitted)
