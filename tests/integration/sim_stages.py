"""Simulated stage actors: the real `actors._stage.StageActor` protocol with simulated work.

For integration tests and benchmarks of the reconciler on a real bus: each kind takes its real work
order, heart-beats, sleeps a long-tailed (lognormal) time, sometimes fails, and reports a correct
completion on ``done.<stage>``:

- `SimRolloutActor`: a `RolloutDone` whose min/max policy versions respect the order's floor and the
  versions the simulated trainer announced while it "generated". With ``rollout_turns`` > 1 an episode is
  that many turns of ``rollout_tokens_per_turn`` tokens (each turn one draw of the stage's duration, and a
  ``sim_rollout_turn`` event: what the chaos test counts as generated), and with ``rollout_checkpoints``
  it writes a real rollout checkpoint (actors.rollout_checkpoint, an empty workspace) after each turn and
  a re-issued attempt resumes from the newest one within the staleness bound, as the real rollout does.
- `SimRewardActor`: reads the rollout record, scores it, writes a reward record (`RewardDone`).
- `SimGroupActor`: reads the reward records, Dr. GRPO advantages, writes a group record (`GroupDone`).
- `SimTrainActor`: keeps a ledger of trained groups and decided batch ids in the ``sim_trainer`` KV
  bucket (one record, every step one compare-and-set), so it trains each group at most once across
  restarts whatever batch id an order gives it, answers an order whose groups were all trained with
  their recorded version, and refuses batches past their ``deadline_version``.

Knobs: the run directory's ``sim_stages.json`` (`SimConfig.write` makes it; absent: the defaults).
A file in the run directory rather than a section of the run's shared schema (`actors.config.RLConfig`
is the real run's, and must not grow test-only keys) or environment variables (process-global, and
lost on ``--resume``): the knobs travel with the run, every process of it reads the same ones, and
a resumed run keeps them.

Failures: ``refuse_rate`` raises `WorkRefused` (reported as `StageFailed`: a counted retry for
rollout, reward and group; a train refusal drops the batch for good and is recorded in the ledger),
``error_rate`` raises a plain exception (the actor base naks and the order is redelivered).
With ``records`` off, no blobs are written or read: the no-op stages of tests/bench/lifecycle.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import msgpack
import structlog
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from actors._stage import StageActor, WorkRefused
from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.messages import WeightsPublished
from actors.reconciler.slot import Stage
from actors.reconciler.work import (
    GroupDone,
    GroupOrder,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    TrainDone,
    TrainOrder,
)
from actors.records import RECORD_SCHEMA
from actors.rollout_checkpoint import RolloutCheckpoint, RolloutCheckpoints
from actors.stages.evaluator_role import EvaluatorRole
from actors.weights_announcements import weights_run_name
from runtime.actor import Delivery
from runtime.bus_auth import BusAccess
from runtime.codec import Codec

log = structlog.get_logger(__name__)

__all__ = [
    "LEDGER_BUCKET",
    "LEDGER_KEY",
    "SIM_CONFIG_FILE",
    "SimConfig",
    "SimError",
    "SimEvaluatorActor",
    "SimGroupActor",
    "SimRewardActor",
    "SimRolloutActor",
    "SimTrainActor",
    "StageSim",
    "TrainerLedger",
    "sim_run_toml",
]

SIM_CONFIG_FILE = "sim_stages.json"
LEDGER_BUCKET = "sim_trainer"
LEDGER_KEY = "ledger"
LEDGER_VERSION_KEY = "version"  # the ledger's version alone, for readers that need nothing else


SIM_RUN_TEMPLATE = """
[run]
name = "sim"
[bus]
ack_wait_s = 4.0
[supervisor]
max_restarts = 1000
restart_window_s = 60.0
backoff_base_s = 0.2
backoff_max_s = 1.0
[actors.reconciler]
entry = "{reconciler_entry}"
max_concurrency = 64
heartbeat_s = 1.0
[actors.rollout]
entry = "tests.integration.sim_stages:SimRolloutActor"
count = {rollout_count}
max_concurrency = 64
heartbeat_s = 1.0
[actors.reward]
entry = "tests.integration.sim_stages:SimRewardActor"
count = {reward_count}
max_concurrency = 64
heartbeat_s = 1.0
[actors.grouping]
entry = "tests.integration.sim_stages:SimGroupActor"
max_concurrency = 16
heartbeat_s = 1.0
[actors.trainer]
entry = "tests.integration.sim_stages:SimTrainActor"
max_concurrency = 1
heartbeat_s = 1.0
[tasks]
num_train = {num_prompts}
num_heldout = 4
difficulties = [1, 2, 3, 4]  # all: the simulated stages never look at a task, only at its position
[reconciler]
num_slots = {num_slots}
group_size = {group_size}
batch_size_groups = {batch_groups}
num_epochs = 1  # single epoch: the tests account for every prompt trained once
tick_s = 0.25
[reconciler.scheduling]
eta = {eta}
max_retries = 3
max_inflight_per_rollout_actor = {max_inflight_per_rollout_actor}
adopt_on_resume = {adopt_on_resume}
failed_group_policy = "train_rest"
rollout_timeout_s = {stage_timeout_s}
reward_timeout_s = {stage_timeout_s}
group_timeout_s = {stage_timeout_s}
train_timeout_s = {train_timeout_s}
"""


def sim_run_toml(
    *,
    num_prompts: int,
    num_slots: int,
    group_size: int,
    batch_groups: int,
    eta: int,
    rollout_count: int = 2,
    reward_count: int = 2,
    reconciler_entry: str = "actors.reconciler:ReconcilerActor",
    max_inflight_per_rollout_actor: int = 64,
    stage_timeout_s: float = 3.0,
    adopt_on_resume: bool = True,
) -> str:
    """A run file: the real reconciler and every simulated stage, with timeouts short enough for tests
    (the train stage's is `stage_timeout_s` + 2 s)."""
    return SIM_RUN_TEMPLATE.format(
        num_prompts=num_prompts,
        num_slots=num_slots,
        group_size=group_size,
        batch_groups=batch_groups,
        eta=eta,
        rollout_count=rollout_count,
        reward_count=reward_count,
        reconciler_entry=reconciler_entry,
        max_inflight_per_rollout_actor=max_inflight_per_rollout_actor,
        stage_timeout_s=stage_timeout_s,
        train_timeout_s=stage_timeout_s + 2.0,
        adopt_on_resume="true" if adopt_on_resume else "false",
    )


class SimError(RuntimeError):
    """An injected plain failure (not a refusal): the base naks the order and it is redelivered."""


@dataclasses.dataclass(frozen=True)
class StageSim:
    """One stage's simulated work: lognormal duration (median, log-space sigma, cap) and failures.

    Attributes:
        refuse_rate: chance that one handling raises `WorkRefused` (a counted retry).
        error_rate: chance that one handling raises a plain exception (nak, redelivery).
        poison_rate: fraction of keys (sample, group or batch ids, chosen by a hash of the key, so
            every process agrees) refused every time: they end FAILED, or their group dropped.
    """

    median_s: float = 0.02
    sigma: float = 1.0
    max_s: float = 2.0
    refuse_rate: float = 0.0
    error_rate: float = 0.0
    poison_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0 or self.max_s < 0:
            raise ValueError(f"StageSim median_s={self.median_s}, sigma={self.sigma}, max_s={self.max_s} must be >= 0")
        for name in ("refuse_rate", "error_rate", "poison_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"StageSim.{name}={getattr(self, name)} must be in [0, 1)")

    def is_poisoned(self, key: str) -> bool:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.poison_rate

    def duration(self, rng: random.Random) -> float:
        if self.median_s == 0:
            return 0.0
        return min(self.max_s, rng.lognormvariate(math.log(self.median_s), self.sigma))


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Every simulated stage's knobs; lives in ``<run dir>/sim_stages.json``.

    Attributes:
        rollout, reward, group, train: per-stage `StageSim`.
        heartbeat_s: how often a working actor tells the reconciler it is alive.
        records: write and check blob records between stages (off: no-op stages).
        seed: base of every process's random stream (mixed with its pid).
    """

    rollout: StageSim = StageSim()
    reward: StageSim = StageSim()
    group: StageSim = StageSim()
    train: StageSim = StageSim(median_s=0.05, sigma=0.5)
    heartbeat_s: float = 0.5
    records: bool = True
    seed: int = 0
    rollout_turns: int = 1
    rollout_tokens_per_turn: int = 0
    rollout_checkpoints: bool = False

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0:
            raise ValueError(f"SimConfig.heartbeat_s={self.heartbeat_s} must be > 0")
        if self.rollout_turns < 1 or self.rollout_tokens_per_turn < (1 if self.rollout_turns > 1 else 0):
            raise ValueError(f"SimConfig.rollout_turns={self.rollout_turns} must be >= 1 and "
                             f"rollout_tokens_per_turn={self.rollout_tokens_per_turn} >= 1 when it is more")

    def stage(self, stage: Stage) -> StageSim:
        return getattr(self, stage.value)

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / SIM_CONFIG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        return path

    @classmethod
    def read(cls, run_dir: Path) -> SimConfig:
        path = Path(run_dir) / SIM_CONFIG_FILE
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        stages = {s.value: StageSim(**data.pop(s.value, {})) for s in Stage}
        return cls(**stages, **data)


class _SimStage(StageActor):
    """Loads the knobs, sleeps the stage's time, injects the stage's failures."""

    async def setup(self) -> None:
        self.sim = SimConfig.read(Path(self.ctx.run_dir))
        self.heartbeat_every_s = self.sim.heartbeat_s
        self.rng = random.Random(self.sim.seed * 1_000_003 + os.getpid())

    async def simulate(self, what: str, *, sleep: bool = True) -> None:
        knobs = self.sim.stage(self.stage)
        duration = knobs.duration(self.rng) if sleep else 0.0
        if duration:
            await asyncio.sleep(duration)
        if knobs.is_poisoned(what):
            raise WorkRefused(f"simulated poison {self.stage.value} {what}: refused every time")
        roll = self.rng.random()
        if roll < knobs.refuse_rate:
            raise WorkRefused(f"simulated refusal of {self.stage.value} {what}")
        if roll < knobs.refuse_rate + knobs.error_rate:
            raise SimError(f"simulated error in {self.stage.value} {what}")

    async def put(self, key: str, record: dict[str, Any], ready: bool = False) -> str:
        if self.sim.records:  # an untyped record, of the schema the stage base reads
            await self.put_record(key, {**record, "schema": RECORD_SCHEMA}, ready=ready)
        return key


class SimRolloutActor(_SimStage):
    stage = Stage.ROLLOUT
    bus_access = BusAccess(subscribe=("weights.*",), kv_write=(LEDGER_BUCKET,))  # the first to ask creates it

    async def setup(self) -> None:
        await super().setup()
        self.ledger = await TrainerLedger.open(self.bus)
        self.version = await self.ledger.version()  # a restart resumes at it
        self.weights_codec = Codec([WeightsPublished])
        subject = f"weights.{weights_run_name(self.ctx)}"
        sub = await self.bus.subscribe(subject, self._on_weights)
        self.exit_stack.push_async_callback(sub.unsubscribe)

    async def _on_weights(self, raw: Any) -> None:
        """As the real follower does, believes an announcement only for a version the trainer made
        (here: its ledger holds it); anything else is rejected with the reason."""
        try:
            version = (await self.weights_codec.decode(raw.data)).version
        except ValueError as e:
            log.warning("weights_signal_rejected", error=str(e))
            return
        if version > self.version:
            trained = await self.ledger.version()
            if version > trained:
                log.warning("weights_signal_rejected", version=version,
                            reason=f"the trainer's ledger is at version {trained}")
                return
            self.version = version

    async def work(self, order: RolloutOrder, delivery: Delivery) -> RolloutDone:
        self.version = max(self.version, order.policy_version_floor)  # "fetch" the floor's weights
        if self.sim.rollout_turns == 1:
            min_version = self.version
            await self.simulate(order.sample_id)
            max_version = self.version
        else:
            min_version, max_version = await self._turns(order, delivery)
            await self.simulate(order.sample_id, sleep=False)
        key = await self.put(
            f"samples/{order.sample_id}/a{order.attempt}/trajectory",
            {
                "sample_id": order.sample_id,
                "prompt_id": order.prompt_id,
                "group_id": order.group_id,
                "min_version": min_version,
                "max_version": max_version,
            },
        )
        return RolloutDone(order.sample_id, order.attempt, key, min_version, max_version)

    async def _turns(self, order: RolloutOrder, delivery: Delivery) -> tuple[int, int]:
        """The episode's turns, from the newest usable checkpoint on; (min, max) version of its tokens."""
        sim, checkpoints = self.sim, RolloutCheckpoints(self.ctx.blob)
        traj = Trajectory([Segment.of_prompt([])], EpisodeEnd.TURN_BUDGET)  # one segment: no summaries here
        if sim.rollout_checkpoints and (order.attempt > 0 or delivery.num_delivered > 1):
            resume = await checkpoints.newest(order.sample_id, order.prompt_id, order.attempt,
                                              version_floor=self.version, eta=self.config.reconciler.scheduling.eta)
            if resume.checkpoint is not None:
                traj = resume.checkpoint.trajectory
                log.info("rollout_resumed", sample_id=order.sample_id, attempt=order.attempt,
                         num_turns=resume.num_turns)
            else:
                log.info("rollout_started_over", sample_id=order.sample_id, attempt=order.attempt,
                         reason=resume.reason)
        n = sim.rollout_tokens_per_turn
        while traj.num_turns < sim.rollout_turns:
            duration = sim.rollout.duration(self.rng)
            if duration:
                await asyncio.sleep(duration)
            seg = traj.segments[-1]
            seg.token_ids += [traj.num_turns % 256] * n
            seg.loss_mask += [1] * n
            seg.behaviour_logprobs += [-1.0] * n
            seg.logprob_temperatures += [1.0] * n
            seg.versions += [self.version] * n
            traj.num_turns += 1
            log.info("sim_rollout_turn", sample_id=order.sample_id, attempt=order.attempt, num_tokens=n)
            if sim.rollout_checkpoints and traj.num_turns < sim.rollout_turns:
                await checkpoints.write(RolloutCheckpoint(order.sample_id, order.prompt_id, order.attempt, 0, traj,
                                                          b""))
        return traj.min_version, traj.max_version


class SimRewardActor(_SimStage):
    stage = Stage.REWARD

    async def work(self, order: RewardOrder, delivery: Delivery) -> RewardDone:
        reward = random.Random(order.sample_id).random()  # a pure function of the sample
        record: dict[str, Any] = {"sample_id": order.sample_id, "reward": reward}
        if self.sim.records:
            rollout = await self.get_record(order.rollout_key, dict)
            if rollout["sample_id"] != order.sample_id:
                raise WorkRefused(
                    f"rollout record {order.rollout_key} is {rollout['sample_id']}, not {order.sample_id}"
                )
            record.update(min_version=rollout["min_version"], max_version=rollout["max_version"])
        await self.simulate(order.sample_id)
        key = await self.put(f"samples/{order.sample_id}/a{order.attempt}/reward", record)
        return RewardDone(order.sample_id, order.attempt, key)


class SimGroupActor(_SimStage):
    stage = Stage.GROUP

    async def work(self, order: GroupOrder, delivery: Delivery) -> GroupDone:
        if len(order.sample_ids) != len(order.reward_keys) or not order.sample_ids:
            raise WorkRefused(
                f"group {order.group_id}: {len(order.sample_ids)} samples, {len(order.reward_keys)} reward keys"
            )
        record: dict[str, Any] = {
            "group_id": order.group_id,
            "prompt_id": order.prompt_id,
            "sample_ids": list(order.sample_ids),
        }
        if self.sim.records:
            rewards = [await self.get_record(k, dict) for k in order.reward_keys]
            if [r["sample_id"] for r in rewards] != list(order.sample_ids):
                raise WorkRefused(f"group {order.group_id}: reward records do not match its samples")
            mean = sum(r["reward"] for r in rewards) / len(rewards)
            record.update(
                advantages=[r["reward"] - mean for r in rewards], min_version=min(r["min_version"] for r in rewards)
            )
        await self.simulate(order.group_id)
        key = await self.put(f"groups/{order.group_id}/a{order.attempt}", record, ready=True)
        return GroupDone(order.group_id, order.attempt, key)


class SimTrainActor(_SimStage):
    stage = Stage.TRAIN
    bus_access = BusAccess(publish=("weights.*",), kv_write=(LEDGER_BUCKET,))

    async def setup(self) -> None:
        await super().setup()
        self.ledger = await TrainerLedger.open(self.bus)
        state, _ = await self.ledger.load()
        self.version, self.num_trained_batches = state["version"], len(state["trained"])
        await self.ledger.mark_version(self.version)  # a predecessor may have died between its commit and mark
        self.weights_codec = Codec([WeightsPublished])
        self.run_name = weights_run_name(self.ctx)

    async def work(self, order: TrainOrder, delivery: Delivery) -> TrainDone:
        state, revision = await self.ledger.load()
        trained = {g: state["groups"][g] for g in order.group_ids if g in state["groups"]}
        if trained and len(trained) == len(order.group_ids):
            log.info("batch_already_trained", batch_id=order.batch_id, version=max(trained.values()))
            return TrainDone(order.batch_id, order.attempt, max(trained.values()))
        if trained:
            raise WorkRefused(f"batch {order.batch_id} names groups already trained {sorted(trained)}")
        if order.batch_id in state["refused"]:
            raise WorkRefused(state["refused"][order.batch_id])
        version = state["version"]
        try:
            if version > order.deadline_version:
                raise WorkRefused(
                    f"trainer at version {version} is past batch {order.batch_id}'s deadline {order.deadline_version}"
                )
            groups = await self._check_groups(order)
            await self.simulate(order.batch_id)
        except WorkRefused as e:
            state["refused"][order.batch_id] = str(e)
            await self.ledger.commit(state, revision)
            raise
        state["version"] = version + 1
        state["groups"].update(dict.fromkeys(order.group_ids, version + 1))
        state["trained"][order.batch_id] = {
            "version": version + 1,
            "time": time.time(),
            "trained_at_version": version,
            "group_ids": list(order.group_ids),
            "sample_ids": list(order.sample_ids),
            **groups,
        }
        await self.ledger.commit(state, revision)  # the step's effect: once, or not at all
        self.version, self.num_trained_batches = version + 1, len(state["trained"])
        signal = WeightsPublished(self.run_name, version + 1, "", 0)
        await self.bus.publish(f"weights.{self.run_name}", await self.weights_codec.encode(signal))
        log.info("batch_trained", batch_id=order.batch_id, version=version + 1, num_samples=len(order.sample_ids))
        return TrainDone(order.batch_id, order.attempt, version + 1)

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "num_trained_batches": self.num_trained_batches}

    async def _check_groups(self, order: TrainOrder) -> dict[str, Any]:
        """The batch's prompt ids and oldest token version, from its group records."""
        if not self.sim.records:
            return {}
        groups = await self.get_records(list(order.group_keys), dict, ready=True)  # says ready_samples_read
        if [g["group_id"] for g in groups] != list(order.group_ids):
            raise WorkRefused(f"batch {order.batch_id}: group records do not match its groups")
        return {"prompt_ids": [g["prompt_id"] for g in groups], "min_version": min(g["min_version"] for g in groups)}


class TrainerLedger:
    """The simulated trainer's durable decisions: version, trained and refused batch ids (one KV record)."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, bus: Any) -> TrainerLedger:
        return cls(await bus.kv(LEDGER_BUCKET))

    async def load(self) -> tuple[dict[str, Any], int]:
        """The ledger and its revision (0: none yet)."""
        try:
            entry = await self._kv.get(LEDGER_KEY)
        except KeyNotFoundError:
            return {"version": 0, "trained": {}, "refused": {}, "groups": {}}, 0
        return msgpack.unpackb(entry.value, raw=False), entry.revision

    async def version(self) -> int:
        """The version of the trainer's last committed step: read from its own small record (`mark_version`),
        not from the ledger, which grows with every trained batch and is read on every announcement."""
        try:
            entry = await self._kv.get(LEDGER_VERSION_KEY)
        except KeyNotFoundError:
            return (await self.load())[0]["version"]  # no step recorded yet (or a ledger from before the record)
        return int(msgpack.unpackb(entry.value))

    async def mark_version(self, version: int) -> None:
        """Record ``version`` as the committed one (after `commit`: it never names a step the ledger lacks)."""
        await self._kv.put(LEDGER_VERSION_KEY, msgpack.packb(version))

    async def commit(self, state: dict[str, Any], revision: int) -> int:
        """Compare-and-set; a conflict means another trainer decided meanwhile: nak and decide again."""
        data = msgpack.packb(state, use_bin_type=True)
        try:
            if revision == 0:
                revision = await self._kv.create(LEDGER_KEY, data)
            else:
                revision = await self._kv.update(LEDGER_KEY, data, last=revision)
        except KeyWrongLastSequenceError:
            raise SimError("the trainer ledger changed under this step; retrying the order") from None
        await self.mark_version(state["version"])
        return revision


class SimEvaluatorActor(EvaluatorRole):
    """The evaluator's role without its model: it may ask the supervisor to finish the run, and a finish is
    believed only as the real evaluator's check of the table and the metrics says (actors.run_end)."""
