"""Reading the actor registry (the ``actors`` KV bucket) without believing whatever is written there.

Each actor writes its own entry under its id (`runtime.actor.Actor.describe`). A reader that acts on
entries (the reconciler counts running rollout actors to size admission) decodes them through
`decode_registration`, which accepts only a complete entry: every field an actor writes, of its
type, under the key of its own id, whose id names its kind, in a state the actor lifecycle has.
Anything else is refused with the reason. ``handover.<kind>`` records share the bucket and are not
registrations (`is_registration_key`).
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["REGISTRATION_FIELDS", "decode_registration", "is_registration_key"]

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
HANDOVER_PREFIX = "handover."


def is_registration_key(key: str) -> bool:
    return not key.startswith(HANDOVER_PREFIX)


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
    if info["id"] != key:
        raise ValueError(f"registry entry {key!r} describes another actor, {info['id']!r}")
    if not info["kind"] or not key.startswith(f"{info['kind']}-"):
        raise ValueError(f"registry entry {key!r}: an actor of kind {info['kind']!r} has an id '<kind>-...'")
    if info["state"] not in _STATES:
        raise ValueError(f"registry entry {key!r}: state {info['state']!r} is none of {sorted(_STATES)}")
    if info["pid"] <= 0 or min(info["num_inflight"], info["num_handled"], info["num_failed"]) < 0:
        raise ValueError(f"registry entry {key!r}: pid and counts must be positive")
    return info
