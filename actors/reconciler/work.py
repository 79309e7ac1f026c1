"""What goes into and comes out of the lifecycle core: work orders, completions, durable side records.

Orders are what the reconciler publishes on ``work.<stage>`` (with `msg_id` as the JetStream
message id, so a re-publish of the same attempt is deduplicated); completions are what it consumes
from ``done.<stage>``. Both are plain frozen dataclasses; the reconciler actor maps them to its wire
messages. Completions are idempotent by (key, stage, attempt, token): the core ignores any whose attempt is
not the current one, or whose slot has moved on, and rejects (counted, with an event) any whose token is
not the one it issued.

Every order carries an issuance `token`: unguessable, drawn afresh whenever the core issues a stage
with a new attempt, and recorded with the slot. A stage actor copies it into its completion (see
`bound_to`); the JetStream message ids of orders and completions contain it, so nobody who has not
seen the order can pre-empt either with a duplicate under a predictable id.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, ClassVar

import msgpack

from actors.reconciler.slot import SlotDecodeError, Stage

__all__ = [
    "Completion",
    "GroupDone",
    "GroupOrder",
    "GroupOutcome",
    "MetaRecord",
    "RewardDone",
    "RewardGroupDone",
    "RewardGroupOrder",
    "RewardOrder",
    "RolloutDone",
    "RolloutGroupDone",
    "RolloutGroupOrder",
    "RolloutOrder",
    "SampleGroupDone",
    "SampleGroupOrder",
    "StageFailed",
    "TrainDone",
    "TrainOrder",
    "WorkOrder",
    "bound_to",
    "group_done",
    "group_orders",
]


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutOrder:
    """Generate one sample. The actor must use weights of version >= `policy_version_floor`."""

    STAGE: ClassVar[Stage] = Stage.ROLLOUT
    sample_id: str
    attempt: int
    prompt_id: str
    group_id: str
    index_in_group: int
    policy_version_floor: int
    token: str = ""

    @property
    def key(self) -> str:
        return self.sample_id

    @property
    def msg_id(self) -> str:
        return f"{self.STAGE}.{self.key}.{self.attempt}.{self.token}"


@dataclasses.dataclass(frozen=True, slots=True)
class RewardOrder:
    """Score one finished rollout (its trajectory is at `rollout_key`)."""

    STAGE: ClassVar[Stage] = Stage.REWARD
    sample_id: str
    attempt: int
    prompt_id: str
    group_id: str
    rollout_key: str
    token: str = ""

    @property
    def key(self) -> str:
        return self.sample_id

    @property
    def msg_id(self) -> str:
        return f"{self.STAGE}.{self.key}.{self.attempt}.{self.token}"


@dataclasses.dataclass(frozen=True, slots=True)
class GroupOrder:
    """Compute advantages over the group's surviving samples and checkpoint it."""

    STAGE: ClassVar[Stage] = Stage.GROUP
    group_id: str
    attempt: int
    prompt_id: str
    sample_ids: tuple[str, ...]
    reward_keys: tuple[str, ...]
    token: str = ""

    @property
    def key(self) -> str:
        return self.group_id

    @property
    def msg_id(self) -> str:
        return f"{self.STAGE}.{self.key}.{self.attempt}.{self.token}"


@dataclasses.dataclass(frozen=True, slots=True)
class TrainOrder:
    """Train one step on these groups.

    The trainer keeps a ledger of trained groups (group id -> version) with its checkpoint: a group
    trains at most once whatever order names it, so it answers an order whose groups were all
    trained with a `TrainDone` and refuses one that names some trained and some untrained groups;
    it rejects a batch with `StageFailed` (for good: every later attempt gets the same answer) if
    its version exceeds `deadline_version` (training would break the staleness bound) or it cannot
    train it. A group whose record cannot be read is left out and named in `TrainDone.dropped`: the
    rest trains. The core drops a rejected batch's groups with the reason; a batch whose trainer
    timed out or was lost is re-issued without bound, never dropped, since it may have trained.
    It checks its ledger before the deadline.
    """

    STAGE: ClassVar[Stage] = Stage.TRAIN
    batch_id: str
    attempt: int
    group_ids: tuple[str, ...]
    group_keys: tuple[str, ...]
    sample_ids: tuple[str, ...]
    trainer_version: int
    deadline_version: int
    token: str = ""

    @property
    def key(self) -> str:
        return self.batch_id

    @property
    def msg_id(self) -> str:
        return f"{self.STAGE}.{self.key}.{self.attempt}.{self.token}"


WorkOrder = RolloutOrder | RewardOrder | GroupOrder | TrainOrder


def _items_digest(items: tuple[RolloutOrder, ...] | tuple[RewardOrder, ...]) -> str:
    """A short digest of the items' (key, attempt, token): unguessable, as each token is."""
    text = "|".join(f"{o.key}.{o.attempt}.{o.token}" for o in items)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutGroupOrder:
    """The rollout orders of one group's samples, sent as one message (the wire form the reconciler uses).

    Each item keeps its own attempt and issuance token and is judged on its own: the stage base
    (`actors._stage.StageActor`) does every item and answers with one `RolloutGroupDone`.
    """

    STAGE: ClassVar[Stage] = Stage.ROLLOUT
    group_id: str
    items: tuple[RolloutOrder, ...]

    @property
    def key(self) -> str:
        return self.group_id

    @property
    def msg_id(self) -> str:
        return f"{self.STAGE}.{self.group_id}.g{_items_digest(self.items)}"


@dataclasses.dataclass(frozen=True, slots=True)
class RewardGroupOrder:
    """The reward orders of one group's samples, sent as one message (see `RolloutGroupOrder`)."""

    STAGE: ClassVar[Stage] = Stage.REWARD
    group_id: str
    items: tuple[RewardOrder, ...]

    @property
    def key(self) -> str:
        return self.group_id

    @property
    def msg_id(self) -> str:
        return f"{self.STAGE}.{self.group_id}.g{_items_digest(self.items)}"


SampleGroupOrder = RolloutGroupOrder | RewardGroupOrder


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutDone:
    STAGE: ClassVar[Stage] = Stage.ROLLOUT
    sample_id: str
    attempt: int
    result_key: str
    min_version: int
    max_version: int
    token: str = ""

    def __post_init__(self) -> None:
        if self.min_version > self.max_version:
            raise ValueError(
                f"RolloutDone {self.sample_id}: min_version {self.min_version} > max_version {self.max_version}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class RewardDone:
    STAGE: ClassVar[Stage] = Stage.REWARD
    sample_id: str
    attempt: int
    result_key: str
    token: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupDone:
    STAGE: ClassVar[Stage] = Stage.GROUP
    group_id: str
    attempt: int
    result_key: str
    token: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class TrainDone:
    """The batch was trained; `trainer_version` is the trainer's version after the step. `dropped`: the
    groups of the batch that could not be trained (their record missing or corrupt), each with why; the
    rest of the batch trained without them, and the core drops only these."""

    STAGE: ClassVar[Stage] = Stage.TRAIN
    batch_id: str
    attempt: int
    trainer_version: int
    token: str = ""
    dropped: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StageFailed:
    """The actor gave up on this work (error, refused, invalid input); it is retried, bounded."""

    stage: Stage
    key: str
    attempt: int
    reason: str
    token: str = ""


Completion = RolloutDone | RewardDone | GroupDone | TrainDone | StageFailed


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutGroupDone:
    """The answer to a `RolloutGroupOrder`: a completion or a failure per item, each with its token."""

    STAGE: ClassVar[Stage] = Stage.ROLLOUT
    group_id: str
    done: tuple[RolloutDone, ...]
    failed: tuple[StageFailed, ...] = ()

    @property
    def events(self) -> tuple[Completion, ...]:
        return (*self.done, *self.failed)


@dataclasses.dataclass(frozen=True, slots=True)
class RewardGroupDone:
    """The answer to a `RewardGroupOrder` (see `RolloutGroupDone`)."""

    STAGE: ClassVar[Stage] = Stage.REWARD
    group_id: str
    done: tuple[RewardDone, ...]
    failed: tuple[StageFailed, ...] = ()

    @property
    def events(self) -> tuple[Completion, ...]:
        return (*self.done, *self.failed)


SampleGroupDone = RolloutGroupDone | RewardGroupDone


def group_orders(orders: list[WorkOrder]) -> list[WorkOrder | SampleGroupOrder]:
    """The orders as they go on the wire: a group's rollout (reward) orders in one `RolloutGroupOrder`
    (`RewardGroupOrder`), in the order of each group's first one; the other orders as they are."""
    out: list[WorkOrder | SampleGroupOrder] = []
    groups: dict[tuple[Stage, str], list[Any]] = {}
    for order in orders:
        if isinstance(order, RolloutOrder | RewardOrder):
            items = groups.get((order.STAGE, order.group_id))
            if items is None:
                items = groups[(order.STAGE, order.group_id)] = []
                out.append(order)  # a place holder, replaced below
            items.append(order)
        else:
            out.append(order)
    for i, order in enumerate(out):
        if isinstance(order, RolloutOrder):
            out[i] = RolloutGroupOrder(order.group_id, tuple(groups[(order.STAGE, order.group_id)]))
        elif isinstance(order, RewardOrder):
            out[i] = RewardGroupOrder(order.group_id, tuple(groups[(order.STAGE, order.group_id)]))
    return out


def group_done(order: SampleGroupOrder, results: list[Completion]) -> SampleGroupDone:
    """The group completion answering `order` from its items' completions and failures."""
    done = tuple(r for r in results if not isinstance(r, StageFailed))
    failed = tuple(r for r in results if isinstance(r, StageFailed))
    if isinstance(order, RolloutGroupOrder):
        return RolloutGroupDone(order.group_id, done, failed)  # type: ignore[arg-type]
    return RewardGroupDone(order.group_id, done, failed)  # type: ignore[arg-type]


def bound_to(done: Completion, order: WorkOrder) -> Completion:
    """`done` carrying `order`'s issuance token: what a stage actor reports for the order it was given."""
    return dataclasses.replace(done, token=order.token)


def _pack(data: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(data), use_bin_type=True)


def _unpack(raw: bytes, what: str, version: int) -> dict[str, Any]:
    data = msgpack.unpackb(raw, raw=False)
    if not isinstance(data, dict) or data.get("v") != version:
        raise SlotDecodeError(f"{what} record is not a schema-{version} msgpack map: {data!r}")
    return data


@dataclasses.dataclass(frozen=True, slots=True)
class MetaRecord:
    """Run-level durable state beside the table (store key ``meta``).

    The batch in training is recorded here *before* its slots move to TRAIN and cleared *before*
    they are freed, so a resume knows exactly which groups it holds (and that TRAIN slots of any
    other batch were trained).
    """

    SCHEMA: ClassVar[int] = 1
    trainer_version: int = 0
    batch_id: str = ""
    batch_group_ids: tuple[str, ...] = ()
    batch_version: int = 0

    def encode(self) -> bytes:
        return _pack(
            {
                "v": self.SCHEMA,
                "trainer_version": self.trainer_version,
                "batch_id": self.batch_id,
                "batch_group_ids": list(self.batch_group_ids),
                "batch_version": self.batch_version,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> MetaRecord:
        data = _unpack(raw, "meta", cls.SCHEMA)
        return cls(
            trainer_version=int(data["trainer_version"]),
            batch_id=str(data["batch_id"]),
            batch_group_ids=tuple(data["batch_group_ids"]),
            batch_version=int(data["batch_version"]),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class GroupOutcome:
    """A group that did not train whole (store key ``outcome.<group_id>``).

    `dropped` groups are never trained; `trained_rest` groups train without `failed_samples`.
    """

    SCHEMA: ClassVar[int] = 1
    group_id: str
    prompt_id: str
    epoch: int
    position: int
    dropped: bool
    reason: str
    failed_samples: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def encode(self) -> bytes:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["failed_samples"] = dict(self.failed_samples)
        data["v"] = self.SCHEMA
        return _pack(data)

    @classmethod
    def decode(cls, raw: bytes) -> GroupOutcome:
        data = _unpack(raw, "group outcome", cls.SCHEMA)
        data.pop("v")
        return cls(**data)
