"""The actor registry as the reconciler reads it: who is alive, and who was lost and when.

Every actor keeps an entry in the ``actors`` KV bucket (``runtime.actor``): its kind, state and
``lease_s``, renewed every third of its lease while it runs. An entry is a lease: the reader takes
an actor for lost when

- its lease runs out: no renewal seen for ``lease_s`` (a frozen process, a lost host, a process
  killed where nobody removes its entry), measured on the reader's own clock from the moment it saw
  the last renewal, so clocks of other hosts never matter; or the bus itself expired the entry (each
  renewal carries the lease as the key's TTL, `runtime.bus.LEASE_BUCKETS`), which the watch says;
- its entry is deleted while it was not stopped (the supervisor deletes the entry of a process that
  died; a process that stops cleanly says ``stopped`` first, and has finished its work).

A lost actor is reported once; an entry that comes back (a renewal after a pause) makes it alive
again. Pure bookkeeping: the caller feeds it watch events and the time, and acts on what it returns.

A reader that keeps an entry of its own (the ``witness``: the reconciler's) judges an actor only once it
has seen a renewal of its own after that actor's lease ran out: while it misses its own renewals, the
bucket stored nothing (a cluster electing the bucket's leader) or its watch is behind, and everyone's
silence is the registry's, not theirs. The time its own renewals were missed is credited to every
lease, and an entry the bus expired across such a gap is judged by the credited lease, not taken as
lost at once (the bus's TTL ran while no renewal could be stored).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import msgpack

__all__ = ["LostActor", "RegistryView"]

STOPPED = "stopped"


@dataclasses.dataclass(frozen=True)
class LostActor:
    actor_id: str
    kind: str
    reason: str


@dataclasses.dataclass
class _Member:
    kind: str
    state: str
    lease_s: float | None  # None: an entry without a lease never expires
    renewed_at: float
    lost: bool = False
    expired_by_bus: bool = False  # its entry is gone, removed by the bus's TTL across a gap of the witness

    @property
    def running(self) -> bool:
        return self.state == "running" and not self.lost


class RegistryView:
    """Registry entries -> live actors per kind and `LostActor` events (see the module docstring)."""

    def __init__(self, witness: str | None = None, lease_bound_s: float | None = None) -> None:
        """``lease_bound_s``: the run's longest lease (the ``actors`` bucket's max age, the supervisor's rule).
        An entry's own ``lease_s`` is what its writer claims: one claiming a longer lease, or none, is held to
        the bound, so an entry written by hand to last (``Nats-TTL: never``, which the bus's max age spares)
        is still judged lost once it goes unrenewed that long."""
        self._members: dict[str, _Member] = {}
        # running members per kind, kept with every change: every lease renewal asks for it, and a count
        # over the members there would cost O(actors) per renewal, O(actors^2) per lease period
        self._running: Counter[str] = Counter()
        self._witness = witness  # the reader's own entry (see the module docstring)
        self._lease_bound_s = lease_bound_s
        self._witness_gap_ended_at = -math.inf  # when its renewals were last seen again after missed ones

    def observe(self, key: str, value: bytes | None, now: float, expired: bool = False) -> LostActor | None:
        """A watch event: ``value`` is the entry's new value, or None for a delete or purge (``expired``:
        the bus removed it when its TTL ran out)."""
        member = self._members.get(key)
        if value is None:
            if member is None or member.state == STOPPED or member.lost:
                self._remove(key)
                return None
            if expired and member.lease_s is not None and (self._stale(now)
                                                           or now - member.lease_s < self._witness_gap_ended_at):
                member.expired_by_bus = True  # its TTL ran across the witness's gap: `expire` judges it
                return None
            self._remove(key)
            if expired:
                return LostActor(key, member.kind, f"no lease renewal for {now - member.renewed_at:.1f}s: "
                                                   "the bus expired its registry entry")
            return LostActor(key, member.kind, f"its registry entry was removed while {member.state}")
        info = _decode(value)
        if info is None:  # not an actor entry (a handover record) or unreadable: nothing to follow
            return None
        lease = info.get("lease_s")
        lease_s = float(lease) if isinstance(lease, int | float) and lease > 0 else None
        if self._lease_bound_s is not None:
            lease_s = self._lease_bound_s if lease_s is None else min(lease_s, self._lease_bound_s)
        if key == self._witness and member is not None and lease_s is not None:
            self._credit_missed_renewals(member, now, lease_s)
        self._remove(key)
        self._members[key] = new = _Member(str(info["kind"]), str(info["state"]), lease_s, now)
        self._running[new.kind] += new.running
        return None

    def _remove(self, key: str) -> None:
        member = self._members.pop(key, None)
        if member is not None:
            self._running[member.kind] -= member.running

    def _credit_missed_renewals(self, witness: _Member, now: float, lease_s: float) -> None:
        """The witness renews every third of its lease: a longer gap is time the registry could not be
        written or read, which no lease is charged for."""
        gap_s = now - witness.renewed_at
        if gap_s <= _overdue_after(lease_s):
            return
        for m in self._members.values():
            if m is not witness:
                m.renewed_at = min(now, m.renewed_at + gap_s - lease_s / 3)
        self._witness_gap_ended_at = now

    def _witness_member(self) -> _Member | None:
        return self._members.get(self._witness) if self._witness is not None else None

    def _stale(self, now: float) -> bool:
        """The witness's own renewal is overdue: the registry (or this reader's watch of it) is behind."""
        witness = self._witness_member()
        return (witness is not None and witness.lease_s is not None
                and now - witness.renewed_at > _overdue_after(witness.lease_s))

    def expire(self, now: float) -> list[LostActor]:
        """Actors whose lease ran out since the last call (each reported once): before the witness's latest
        renewal seen, when there is a witness (see the module docstring)."""
        witness = self._witness_member()
        seen_live_at = now if witness is None else witness.renewed_at
        lost = []
        for actor_id, m in self._members.items():
            if (m.lost or m.state == STOPPED or m.lease_s is None or seen_live_at - m.renewed_at <= m.lease_s
                    or actor_id == self._witness):
                continue
            self._running[m.kind] -= m.running
            m.lost = True
            gone = ", its entry expired by the bus meanwhile" if m.expired_by_bus else ""
            lost.append(LostActor(actor_id, m.kind, f"no lease renewal for {now - m.renewed_at:.1f}s "
                                                    f"(lease {m.lease_s:g}s{gone})"))
        return lost

    def num_running(self, kind: str) -> int:
        """Actors of ``kind`` running with a live lease."""
        return self._running[kind]


def _overdue_after(lease_s: float) -> float:
    """A renewal due every third of the lease is overdue past half of it (a renewal's own delay allowed)."""
    return lease_s / 2


def _decode(value: bytes) -> dict[str, Any] | None:
    try:
        info = msgpack.unpackb(value, raw=False)
    except ValueError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("kind"), str) or not isinstance(info.get("state"), str):
        return None
    return info
