"""The slot record: one sample future in the reconciler's table, its states and legal transitions.

A slot is the durable unit of the sample lifecycle (DESIGN.md, "The sample lifecycle")::

    EMPTY → ROLLOUT → REWARD → GROUP → READY → TRAIN → EMPTY
               │         │
               └─────────┴── timeout / actor lost → retried (attempt+1, bounded) → FAILED

A `Slot` is immutable; every change produces a new record through `Slot.moved_to` (a state change,
which checks the transition table) or `Slot.retried` (same state, next attempt). The record is
msgpack-serialisable through `to_dict` / `from_dict` with a schema version, so the reconciler can
keep it in a key-value bucket and compare-and-set it on every transition.

Identifiers are deterministic functions of the dataset position, so a restarted reconciler derives
the same ids: ``group_id = "e{epoch}-p{position}"`` and ``sample_id = "{group_id}-s{index_in_group}"``.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import secrets
from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = [
    "SLOT_SCHEMA_VERSION",
    "TRANSITIONS",
    "IllegalTransition",
    "SampleLifecycleError",
    "Slot",
    "SlotDecodeError",
    "SlotState",
    "Stage",
    "group_id_for",
    "new_issuance_token",
    "sample_id_for",
]

SLOT_SCHEMA_VERSION = 1


class SampleLifecycleError(Exception):
    """Base class of the sample-lifecycle errors."""


class IllegalTransition(SampleLifecycleError, ValueError):
    """A slot was asked to move along an edge the lifecycle does not have."""


class SlotDecodeError(SampleLifecycleError, ValueError):
    """A stored slot record could not be decoded (wrong schema version or malformed)."""


class SlotState(enum.StrEnum):
    EMPTY = "empty"
    ROLLOUT = "rollout"
    REWARD = "reward"
    GROUP = "group"
    READY = "ready"
    TRAIN = "train"
    FAILED = "failed"


class Stage(enum.StrEnum):
    """A kind of work the reconciler issues on ``work.<stage>``; each has the slot state of the same name."""

    ROLLOUT = "rollout"
    REWARD = "reward"
    GROUP = "group"
    TRAIN = "train"

    @property
    def state(self) -> SlotState:
        return SlotState(self.value)


# Self-edges on working states are retries (attempt + 1). X → EMPTY frees a slot: after training,
# when its group is dropped, or when a resume rolls back a half-written admission.
TRANSITIONS: Mapping[SlotState, frozenset[SlotState]] = {
    SlotState.EMPTY: frozenset({SlotState.ROLLOUT}),
    SlotState.ROLLOUT: frozenset({SlotState.ROLLOUT, SlotState.REWARD, SlotState.FAILED, SlotState.EMPTY}),
    SlotState.REWARD: frozenset({SlotState.REWARD, SlotState.GROUP, SlotState.FAILED, SlotState.EMPTY}),
    SlotState.GROUP: frozenset({SlotState.GROUP, SlotState.READY, SlotState.EMPTY}),
    SlotState.READY: frozenset({SlotState.TRAIN, SlotState.EMPTY}),
    SlotState.TRAIN: frozenset({SlotState.TRAIN, SlotState.EMPTY}),
    SlotState.FAILED: frozenset({SlotState.EMPTY}),
}

WORKING_STATES = frozenset({SlotState.ROLLOUT, SlotState.REWARD, SlotState.GROUP, SlotState.TRAIN})


def new_issuance_token() -> str:
    """96 random bits: what binds a completion to the order it answers (nobody else can guess it)."""
    return secrets.token_urlsafe(12)


def group_id_for(epoch: int, position: int) -> str:
    return f"e{epoch}-p{position}"


def sample_id_for(group_id: str, index_in_group: int) -> str:
    return f"{group_id}-s{index_in_group}"


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """One row of the slot table.

    Attributes:
        index: position of the slot in the table (its store key is ``slot.<index>``).
        state: lifecycle state.
        sample_id, prompt_id, group_id, index_in_group: what the slot holds (empty strings when EMPTY).
        epoch, position: the dataset cursor position of the prompt (position -1 when EMPTY).
        attempt: issue number of the current stage's work; completions carry it back.
        num_retries: retries in the current stage caused by timeouts, lost actors or failures.
        entered_at: time each state was last entered (seconds, the caller's clock).
        issued_version: trainer version when the current rollout attempt was issued; rollout actors
            must not produce tokens older than it, so it is a floor on the token versions.
        min_version, max_version: policy versions of the sample's tokens, known after the rollout.
        blob_keys: stage name → blob key of that stage's result.
        batch_id: the training batch the slot was handed out in (TRAIN only).
        failure_reason: why the sample failed (FAILED only).
        token: issuance token of the current attempt, drawn afresh each time the slot enters a working
            state or is retried (empty otherwise); a group's or a batch's orders carry the token of
            their first member (see `actors.reconciler.table.SlotTable`).
    """

    index: int
    state: SlotState = SlotState.EMPTY
    sample_id: str = ""
    prompt_id: str = ""
    group_id: str = ""
    index_in_group: int = 0
    epoch: int = 0
    position: int = -1
    attempt: int = 0
    num_retries: int = 0
    entered_at: Mapping[str, float] = dataclasses.field(default_factory=dict)
    issued_version: int = 0
    min_version: int | None = None
    max_version: int | None = None
    blob_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    batch_id: str = ""
    failure_reason: str = ""
    token: str = ""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"Slot.index must be >= 0, got {self.index}")
        if self.state is SlotState.EMPTY and self.sample_id:
            raise ValueError(f"an EMPTY slot holds no sample, got sample_id={self.sample_id!r}")
        if self.state is not SlotState.EMPTY and not self.sample_id:
            raise ValueError(f"slot {self.index} in state {self.state} must hold a sample_id")

    @property
    def is_live(self) -> bool:
        return self.state is not SlotState.EMPTY

    @property
    def cursor_key(self) -> tuple[int, int]:
        return (self.epoch, self.position)

    @property
    def version_floor(self) -> int:
        """Oldest policy version the sample's tokens can have: known after the rollout, else the floor."""
        return self.min_version if self.min_version is not None else self.issued_version

    @classmethod
    def admitted(
        cls,
        index: int,
        *,
        prompt_id: str,
        epoch: int,
        position: int,
        index_in_group: int,
        trainer_version: int,
        now: float,
    ) -> Slot:
        """The ROLLOUT record of a freshly admitted sample (attempt 0)."""
        group_id = group_id_for(epoch, position)
        return cls(
            index=index,
            state=SlotState.ROLLOUT,
            sample_id=sample_id_for(group_id, index_in_group),
            prompt_id=prompt_id,
            group_id=group_id,
            index_in_group=index_in_group,
            epoch=epoch,
            position=position,
            entered_at={SlotState.ROLLOUT.value: now},
            issued_version=trainer_version,
            token=new_issuance_token(),
        )

    def moved_to(self, state: SlotState, now: float, **changes: Any) -> Slot:
        """This slot in `state` (attempt and retries reset), with `changes` applied.

        Raises:
            IllegalTransition: the lifecycle has no edge from the current state to `state`, or
                `state` equals the current state (use `retried` for a retry).
        """
        if state is self.state or state not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"slot {self.index} ({self.sample_id or 'empty'}): no transition {self.state} → {state}; "
                f"allowed: {sorted(s.value for s in TRANSITIONS[self.state] if s is not self.state)}"
            )
        if state is SlotState.EMPTY:
            return Slot(index=self.index)
        entered = dict(self.entered_at)
        entered[state] = now  # a StrEnum: the same key as its value, and packed as it
        token = new_issuance_token() if state in WORKING_STATES else ""
        fields: dict[str, Any] = {"state": state, "attempt": 0, "num_retries": 0, "entered_at": entered, "token": token}
        fields.update(changes)
        return self._evolve(fields)

    def retried(self, now: float, *, count_retry: bool, attempt: int | None = None, **changes: Any) -> Slot:
        """This slot with its current stage re-issued: attempt + 1 (and num_retries + 1 if counted).

        A resume re-issues in-flight work without counting it against the retry bound; a timeout,
        a lost actor or a reported failure counts. `attempt` overrides the new attempt number (a
        group's members all take the group's next attempt); it must exceed the current one.
        """
        if self.state not in WORKING_STATES:
            raise IllegalTransition(f"slot {self.index} in state {self.state} has no work to retry")
        new_attempt = self.attempt + 1 if attempt is None else attempt
        if new_attempt <= self.attempt:
            raise ValueError(f"slot {self.index}: retry attempt {new_attempt} must exceed {self.attempt}")
        entered = dict(self.entered_at)
        entered[self.state] = now
        return self._evolve({
            "attempt": new_attempt,
            "num_retries": self.num_retries + (1 if count_retry else 0),
            "entered_at": entered,
            "token": new_issuance_token(),
            **changes,
        })

    def _evolve(self, changes: Mapping[str, Any]) -> Slot:
        """This slot with `changes` (validated as any new slot; cheaper than ``dataclasses.replace``, which
        the reconciler paid on every transition)."""
        values = dict(zip(_FIELD_NAMES, _field_values(self), strict=True))
        values.update(changes)
        return Slot(**values)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": SLOT_SCHEMA_VERSION, "index": self.index, "state": self.state}  # packs as its value
        if self.state is SlotState.EMPTY:
            return out
        out.update(zip(_SCALAR_FIELDS, _scalar_values(self), strict=True))
        out["entered_at"] = dict(self.entered_at)
        out["blob_keys"] = dict(self.blob_keys)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Slot:
        """Decode a record written by `to_dict`.

        Raises:
            SlotDecodeError: unknown schema version, unknown state or malformed fields.
        """
        version = data.get("v")
        if version != SLOT_SCHEMA_VERSION:
            raise SlotDecodeError(
                f"slot record schema version {version!r} is not {SLOT_SCHEMA_VERSION}; "
                "migrate the slots bucket or start a fresh run"
            )
        fields = {k: v for k, v in data.items() if k in _FIELD_SET}  # a resume decodes every slot: no fields() each
        try:
            fields["state"] = SlotState(fields["state"])
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise SlotDecodeError(f"malformed slot record {dict(data)!r}: {exc}") from exc

    def encode(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> Slot:
        try:
            data = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise SlotDecodeError(f"slot record is not msgpack ({len(raw)} bytes): {exc}") from exc
        if not isinstance(data, dict):
            raise SlotDecodeError(f"slot record must be a msgpack map, got {type(data).__name__}")
        return cls.from_dict(data)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Slot))
_FIELD_SET = frozenset(_FIELD_NAMES)
_SCALAR_FIELDS = tuple(
    f.name for f in dataclasses.fields(Slot) if f.name not in ("index", "state", "entered_at", "blob_keys")
)
# every field's value in one C call: the reconciler evolves and encodes a slot on each transition
_field_values = operator.attrgetter(*_FIELD_NAMES)
_scalar_values = operator.attrgetter(*_SCALAR_FIELDS)
