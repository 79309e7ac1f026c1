"""Reading the actor registry (the ``actors`` KV bucket) without believing whatever is written there.

Each actor writes its own entry (`runtime.actor.Actor.describe`) under ``reg.<kind>.<id>``
(`registration_key`), and a stopping one its state for its replacement under ``handover.<kind>``
(`handover_key`): keys whose subjects (``$KV.actors.<key>``) name the kind, so that the bus lets
each role write its own kind's keys and no other's (`runtime.bus_auth`). A reader that acts on
entries (the reconciler counts running rollout actors to size admission) decodes them through
`decode_registration`, which accepts only a complete entry: every field an actor writes, of its
type, under the key of its own kind and id, whose id names its kind, in a state the actor lifecycle
has. Anything else is refused with the reason.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = [
    "REGISTRATION_FIELDS",
    "actor_kind",
    "decode_registration",
    "handover_key",
    "is_registration_key",
    "parse_registration_key",
    "registration_key",
]

# What `Actor.describe` always writes, and the type of each (kind-specific status fields may follow).
REGISTRATION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "id": str,
    "pid": int,
    "host": str,
    "code_hash": str,
    "state": str,
    "num_inflight": int,
    "num_handled": int,
    "num_failed": int,
    "num_dead_lettered": int,
    "uptime_s": (int, float),
}
_STATES = frozenset({"created", "starting", "standby", "running", "draining", "stopped"})
_REGISTRATION_PREFIX = "reg."
_HANDOVER_PREFIX = "handover."


def registration_key(kind: str, actor_id: str) -> str:
    """Where actor ``actor_id`` of ``kind`` keeps its registry entry (its lease)."""
    return f"{_REGISTRATION_PREFIX}{kind}.{actor_id}"


def actor_kind(actor_id: str) -> str:
    """The kind an actor id names (``<kind>-<n>-<hex>``, the supervisor's ids; a kind may hold '-')."""
    parts = actor_id.rsplit("-", 2)
    return parts[0] if len(parts) == 3 else ""


def handover_key(kind: str) -> str:
    """Where a stopping actor of ``kind`` leaves its state for its replacement."""
    return f"{_HANDOVER_PREFIX}{kind}"


def is_registration_key(key: str) -> bool:
    """Whether ``key`` claims to hold a registration: any key but a handover record's (one that is
    not a `registration_key` then fails `decode_registration`, reported rather than ignored)."""
    return not key.startswith(_HANDOVER_PREFIX)


def parse_registration_key(key: str) -> tuple[str, str] | None:
    """``(kind, actor id)`` of a `registration_key` whose id names its kind; None for any other key
    (a role may write ``reg.rollout.trainer-1-ab``: it names no trainer's lease)."""
    parts = key.split(".")
    if len(parts) != 3 or f"{parts[0]}." != _REGISTRATION_PREFIX or not parts[2].startswith(f"{parts[1]}-"):
        return None
    return parts[1], parts[2]


def decode_registration(key: str, raw: bytes) -> dict[str, Any]:
    """The registry entry stored under `key`, checked complete.

    Raises:
        ValueError: the entry is not msgpack, lacks a field, has one of the wrong type, is stored
            under another id than its own, or names a kind or state it cannot have.
    """
    try:
        info = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"registry entry {key!r} is not msgpack: {e}") from None
    if not isinstance(info, dict):
        raise ValueError(f"registry entry {key!r} is a {type(info).__name__}, not a map")
    for name, kind in REGISTRATION_FIELDS.items():
        value = info.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"registry entry {key!r}: field {name!r} is {value!r}, not {kind}")
    if registration_key(info["kind"], info["id"]) != key:
        raise ValueError(f"registry entry {key!r} describes another actor, {info['kind']!r} {info['id']!r}")
    if not info["kind"] or not info["id"].startswith(f"{info['kind']}-"):
        raise ValueError(f"registry entry {key!r}: an actor of kind {info['kind']!r} has an id '<kind>-...'")
    if info["state"] not in _STATES:
        raise ValueError(f"registry entry {key!r}: state {info['state']!r} is none of {sorted(_STATES)}")
    if info["pid"] <= 0 or min(info["num_inflight"], info["num_handled"], info["num_failed"]) < 0:
        raise ValueError(f"registry entry {key!r}: pid and counts must be positive")
    return info
