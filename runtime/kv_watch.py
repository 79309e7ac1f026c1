"""A KV watch without a consumer: the bucket's current records in one read, then the changes its stream
republishes, merged by stream sequence (transport-free; `runtime.bus.Bus.kv_watch` does the talking).

Why no consumer: whoever may create a consumer on a stream may give it any deliver subject, and the
server does not check that subject against the creator's permissions: a role that reads a bucket could
have the server publish the bucket's records into ``weights.<run>`` or any other subject (issue 31). So
the supervisor gives each bucket's stream a republish rule, ``$KV.<bucket>.>`` to
``kvwatch.<bucket>.>`` (`runtime.bus_auth.kv_watch_subject`), which a bucket's readers may subscribe to
and no role may publish to (the server's own republish is not subject to any user's permissions), and
no actor role may create a consumer on a bucket's stream. A watch is then:

1. subscribe to the republished changes of the keys (kept from then on, none dropped by the client);
2. read the last record of every matching key in one direct get (``multi_last``), a consistent cut
   of the stream at one sequence (`WatchCursor.snapshot_sequence`);
3. the changes after that sequence, in the order the stream stored them (`WatchCursor.admit`).

A republished record names the key's previous record (``Nats-Last-Sequence``): a change whose previous
record is after the cut and is not the last one this watch saw of the key means a change was lost (a
route that learnt of the subscription late, a stream replica behind its leader), and the watch starts
again from a new cut (`Admission.GAP`), as it does after an outage.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Admission", "KVEntry", "WatchCursor", "entry_of"]

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


class Admission(enum.Enum):
    """What a republished record is to a watch: in its snapshot already, new, or after a lost one."""

    OLD = "old"
    NEW = "new"
    GAP = "gap"


@dataclass
class WatchCursor:
    """Where a watch stands: the sequence its snapshot was read at, and the last record of each key since.

    Attributes:
        snapshot_sequence: the stream sequence the snapshot holds every record up to (the direct get's
            ``Nats-UpTo-Sequence``).
    """

    snapshot_sequence: int
    _since: dict[str, int] = field(default_factory=dict)  # key -> sequence of its last record after the cut

    def admit(self, key: str, sequence: int, previous: int) -> Admission:
        """A republished record of ``key`` at ``sequence`` whose key's record before it was at ``previous``
        (0: none stored). A record at or before the cut is in the snapshot (it came between subscribing
        and reading). After the cut, its previous record must be at or before the cut (the snapshot has
        it, or this record superseded it) or be the last one admitted for the key; otherwise one was lost."""
        if sequence <= self.snapshot_sequence:
            return Admission.OLD
        if previous > self.snapshot_sequence and self._since.get(key) != previous:
            return Admission.GAP
        self._since[key] = sequence
        return Admission.NEW
