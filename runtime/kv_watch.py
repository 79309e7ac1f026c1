"""Reading a stream without a consumer: what it holds (one read), then the records it republishes, merged by
stream sequence (transport-free; `runtime.bus.Bus.kv_watch` and `Bus.follow` do the talking).

Why no consumer: whoever may create a consumer on a stream may give it any deliver subject, and the
server does not check that subject against the creator's permissions: a role that reads a bucket could
have the server publish the bucket's records into ``weights.<run>`` or any other subject. So
the supervisor gives each bucket's stream a republish rule, ``$KV.<bucket>.>`` to ``kvwatch.<bucket>.>``
(`runtime.bus_auth.kv_watch_subject`; the event log LOG likewise, ``log.>`` to ``follow.log.>``), which
the stream's readers may subscribe to and no role may publish to (the server's own republish is not
subject to any user's permissions), and no actor role may create a consumer. A KV watch is then:

1. subscribe to every record the bucket's stream republishes (kept from then on, none dropped by the
   client; the keys watched are picked out here, `subject_matches`);
2. read the last record of every matching key in one direct get (``multi_last``), a consistent cut
   of the stream at one sequence (`WatchCursor.sequence`);
3. the records after that sequence, in the order the stream stored them (`WatchCursor.admit`).

The stream republishes every record it stores, one sequence after the other, and the watch receives
all of them: a record that is not the one after the last means one was lost on the way (a route that
learnt of the subscription late, a leader's change), whatever its key, and the watch reads again from
the stream (`Admission.GAP`), as it does after an outage. (Each record also names its key's previous
one, ``Nats-Last-Sequence``; that would notice a lost record only when its key is written again.)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Admission", "KVEntry", "WatchCursor", "entry_of", "subject_matches"]

_OPERATION = "KV-Operation"  # a client's delete (DEL) or purge (PURGE) marker
_MARKER_REASON = "Nats-Marker-Reason"  # a marker the server placed (nats-server >= 2.11)
# what a server-placed marker means for a watcher, as nats-py's own watch reads it: a TTL or max age that
# ran out, or a purge, removes the key as a purge does; a removal as a delete does
_MARKER_OPERATION = {"MaxAge": "PURGE", "Purge": "PURGE", "Remove": "DEL"}


@dataclass(frozen=True)
class KVEntry:
    """One key's record in a KV bucket; ``deleted``: a delete or purge marker (a watch sees them);
    ``purged``: that marker is a purge, a client's or the server's (a TTL or max age that ran out)."""

    key: str
    value: bytes
    revision: int
    deleted: bool = False
    purged: bool = False


def entry_of(key: str, value: bytes, revision: int, headers: Mapping[str, str]) -> KVEntry | None:
    """The entry a stored record of ``key`` is to a watcher, from its headers; None for a marker of a
    reason this does not know (skipped, as nats-py's watch skips it: it is no value either)."""
    operation = headers.get(_OPERATION)
    if operation is None and _MARKER_REASON in headers:
        operation = _MARKER_OPERATION.get(headers[_MARKER_REASON])
        if operation is None:
            return None
    if operation in ("DEL", "PURGE"):
        return KVEntry(key, b"", revision, deleted=True, purged=operation == "PURGE")
    return KVEntry(key, value, revision)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches the NATS ``pattern`` (``*`` one token, a last ``>`` one or more)."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">" and i == len(want) - 1:
            return len(have) > i
        if i >= len(have) or token not in ("*", have[i]):
            return False
    return len(have) == len(want)


class Admission(enum.Enum):
    """What a republished record is to a reader: in what it read already, the next one, or after a lost one."""

    OLD = "old"
    NEW = "new"
    GAP = "gap"


@dataclass
class WatchCursor:
    """Where a reader of a stream stands: the last sequence it has, the cut it read the stream at, then each
    republished record it took.

    Attributes:
        sequence: every record of the stream up to this one is accounted for (read, or taken live).
    """

    sequence: int

    def admit(self, sequence: int) -> Admission:
        """A republished record at ``sequence``: at or before the cut it is in what was read (it came between
        subscribing and reading); the next one is taken; any later one means one before it was lost."""
        if sequence <= self.sequence:
            return Admission.OLD
        if sequence != self.sequence + 1:
            return Admission.GAP
        self.sequence = sequence
        return Admission.NEW
