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
"""

from __future__ import annotations

import dataclasses
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


class RegistryView:
    """Registry entries -> live actors per kind and `LostActor` events (see the module docstring)."""

    def __init__(self) -> None:
        self._members: dict[str, _Member] = {}

    def observe(self, key: str, value: bytes | None, now: float, expired: bool = False) -> LostActor | None:
        """A watch event: ``value`` is the entry's new value, or None for a delete or purge (``expired``:
        the bus removed it when its TTL ran out)."""
        member = self._members.get(key)
        if value is None:
            self._members.pop(key, None)
            if member is None or member.state == STOPPED or member.lost:
                return None
            if expired:
                return LostActor(key, member.kind, f"no lease renewal for {now - member.renewed_at:.1f}s: "
                                                   "the bus expired its registry entry")
            return LostActor(key, member.kind, f"its registry entry was removed while {member.state}")
        info = _decode(value)
        if info is None:  # not an actor entry (a handover record) or unreadable: nothing to follow
            return None
        lease = info.get("lease_s")
        self._members[key] = _Member(str(info["kind"]), str(info["state"]),
                                     float(lease) if isinstance(lease, int | float) and lease > 0 else None, now)
        return None

    def expire(self, now: float) -> list[LostActor]:
        """Actors whose lease ran out since the last call (each reported once)."""
        lost = []
        for actor_id, m in self._members.items():
            if m.lost or m.state == STOPPED or m.lease_s is None or now - m.renewed_at <= m.lease_s:
                continue
            m.lost = True
            lost.append(LostActor(actor_id, m.kind, f"no lease renewal for {now - m.renewed_at:.1f}s "
                                                    f"(lease {m.lease_s:g}s)"))
        return lost

    def num_running(self, kind: str) -> int:
        """Actors of ``kind`` running with a live lease."""
        return sum(m.kind == kind and m.state == "running" and not m.lost for m in self._members.values())


def _decode(value: bytes) -> dict[str, Any] | None:
    try:
        info = msgpack.unpackb(value, raw=False)
    except ValueError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("kind"), str) or not isinstance(info.get("state"), str):
        return None
    return info
