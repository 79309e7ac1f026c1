"""Fuzzing a live run's bus: 10,000 malformed, truncated, wrongly typed, oversized, duplicated, stale and
spoofed messages on every work, done, heartbeat, control, weights, data_exhausted and KV subject.

Each subject is fuzzed with the credentials of the role allowed to publish on it (what gets past the
server and must be refused by the receiver) and with another role's (what the server must refuse);
clients without credentials are refused at connect. No actor may crash, the run must finish with the
trained set of an undisturbed run of the same seed and configuration, run first in the same test, and
what was refused must show up as dead letters and counted rejections with reasons.

"The same trained set" is: the same groups, each trained exactly once, each with the same samples, in
as many versions. Not the same batches: which ready groups the reconciler puts in a batch, and in
which order the batches train, follow the wall clock (the simulated stage durations are seeded, the
scheduling of a dozen processes on a loaded machine is not), so two undisturbed runs of one seed
already differ there; the trainer's ledger checks the rest (a group in two batches fails).

Bounded: two small simulated runs (real reconciler, real nats-server with auth), a minute or two each
on two cores. The generator is seeded, so a failure reproduces.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from actors.messages import COMPLETION_TYPES, DataExhausted, WeightsPublished, WorkHeartbeat, all_order_types
from actors.reconciler.slot import Slot, SlotState, Stage
from actors.reconciler.store import META_KEY, SLOT_PREFIX
from actors.reconciler.work import (
    GroupDone,
    GroupOrder,
    MetaRecord,
    RewardDone,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    StageFailed,
    TrainDone,
    TrainOrder,
)
from runtime.bus_auth import OPERATOR, control_subject
from runtime.codec import SCHEMA_VERSION, Codec
from runtime.registry import handover_key, registration_key
from tests.integration.bus_clients import RoleClient, connect_anonymously, connect_as
from tests.integration.harness import LiveRun, write_config
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
from tests.integration.test_bus_trust import events
from tests.waiting import until

pytestmark = pytest.mark.timeout(420)

NUM_MESSAGES = 10_000
NUM_PROMPTS, GROUP_SIZE, BATCH_GROUPS = 24, 2, 2
STAGE_ROLE = {Stage.ROLLOUT: "rollout", Stage.REWARD: "reward", Stage.GROUP: "grouping", Stage.TRAIN: "trainer"}
INVALID_CONFIG: list[tuple[str, list[Any]]] = [
    ("reconciler.scheduling.eta", [-1, "x", None, 1.5, [1]]),
    ("reconciler.scheduling.max_ready_groups", [0, 1, -1, "x", 2.5]),  # 1 < the batch: no batch could form
    ("reconciler.scheduling.rollout_timeout_s", [0, -1.0, "x", None, {"a": 1}]),
    ("trainer.lr", [0, -1e-3, "x", None]),
    ("reconciler.scheduling.failed_group_policy", ["x", 1, None]),
    ("reconciler.num_slots", [16]),  # not live
    ("no.such.key", [1]),
]
# never stop, swap or drain (an operator's to decide); finish, as premature as any: refused by the durable state
SAFE_CTL_VERBS = ("ping", "status", "nonsense", "", "drain.now", "sw@p", "finish")


class Fuzzer:
    """Seeded generator of hostile payloads, shaped from the run's real message types."""

    def __init__(self, seed: int, run_name: str) -> None:
        self.rng = random.Random(seed)
        self.run_name = run_name
        self.orders, self.completions = Codec(all_order_types()), Codec(COMPLETION_TYPES)
        self.kinds: Counter[str] = Counter()

    def key(self) -> str:
        r = self.rng
        return r.choice([f"e0-p{r.randrange(NUM_PROMPTS)}-s{r.randrange(GROUP_SIZE)}", f"e0-p{r.randrange(99)}",
                         f"b{r.randrange(20)}-e0-p{r.randrange(NUM_PROMPTS)}", "", "x" * r.randrange(1, 300)])

    def token(self) -> str:
        return self.rng.choice(["", "0" * 16, "AAAAAAAAAAAAAAAA", self.rng.randbytes(12).hex(), "tökén-ünicode-✓",
                                "\x00" * 16])

    def value(self) -> Any:
        r = self.rng
        return r.choice([None, True, -1, 2**63 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 50,
                         b"\x00\xff", [], [1, "a"], {}, {"a": 1}, 10**9])

    def order(self, stage: Stage) -> Any:
        r, k, t = self.rng, self.key(), self.token()
        a = r.choice([0, 1, 3, 50, 2**31])
        return {
            Stage.ROLLOUT: lambda: RolloutOrder(k, a, f"p{r.randrange(9)}", k, r.randrange(4), r.randrange(3), t),
            Stage.REWARD: lambda: RewardOrder(k, a, "p", k, f"sim/rollouts/{k}/a0", t),
            Stage.GROUP: lambda: GroupOrder(k, a, "p", (k,), (f"sim/rewards/{k}/a0",), t),
            # made-up group ids only: a forged order naming real untrained groups would need the
            # reconciler's own credentials to be believed by the trainer, which is beyond this test
            Stage.TRAIN: lambda: TrainOrder(f"b-{k}", a, (f"fz-{k}",), ("nowhere",), (k,), 0, r.randrange(99), t),
        }[stage]()

    def completion(self, stage: Stage) -> Any:
        r, k, t = self.rng, self.key(), self.token()
        a = r.choice([0, 0, 1, 2, 50])
        if r.random() < 0.2:
            return StageFailed(stage, k, a, "fuzz", t)
        return {
            Stage.ROLLOUT: lambda: RolloutDone(k, a, "forged", r.randrange(3), r.randrange(3, 10**6), t),
            Stage.REWARD: lambda: RewardDone(k, a, "forged", t),
            Stage.GROUP: lambda: GroupDone(k, a, "forged", t),
            Stage.TRAIN: lambda: TrainDone(k, a, r.choice([1, 10**9]), t),
        }[stage]()

    async def typed(self, codec: Codec, msg: Any) -> bytes:
        """A valid envelope of `msg` (a spoof), or one of its mangled variants."""
        data = await codec.encode(msg)
        r = self.rng
        kind = r.choice(["spoof", "spoof", "truncated", "wrong_type", "unknown_field", "wrong_version", "bare"])
        self.kinds[kind] += 1
        if kind == "truncated":
            return data[: r.randrange(len(data))]
        env = msgpack.unpackb(data, raw=False)
        body = msgpack.unpackb(env["body"], raw=False)
        if kind == "wrong_type":
            body[r.choice(sorted(body))] = self.value()
        elif kind == "unknown_field":
            body["extra"] = self.value()
        elif kind == "wrong_version":
            env[r.choice(["v", "schema", "type"])] = self.value()
        elif kind == "bare":
            return msgpack.packb(body, use_bin_type=True)
        env["body"] = msgpack.packb(body, use_bin_type=True, default=str)
        return msgpack.packb(env, use_bin_type=True, default=str)

    def garbage(self) -> bytes:
        r = self.rng
        kind = r.choice(["random", "empty", "not_a_map", "no_body", "blob", "oversized"])
        self.kinds[kind] += 1
        if kind == "random":
            return r.randbytes(r.randrange(1, 2000))
        if kind == "empty":
            return b""
        if kind == "not_a_map":
            return msgpack.packb([self.value() for _ in range(3)], use_bin_type=True, default=str)
        if kind == "no_body":
            return msgpack.packb({"schema": SCHEMA_VERSION, "type": "done.rollout", "v": 1}, use_bin_type=True)
        if kind == "blob":  # a body "in storage" anywhere: outside the store, a name too long, another's object
            key = r.choice(["../../../etc/passwd", "x" * 5000, "sim/rollouts/e0-p0-s0/a0",
                            f"messages/done.rollout/{r.randbytes(32).hex()}"])
            return msgpack.packb({"schema": SCHEMA_VERSION, "type": r.choice(["done.rollout", "order.train"]),
                                  "v": 1, "blob": key, "size": 10}, use_bin_type=True)
        return b"\x00" * (r.randrange(1, 3) * 700 * 1024)  # above the codec's 1 MiB only sometimes; rare


async def fuzz(clients: dict[str, RoleClient], f: Fuzzer, actors: list[tuple[str, str]]) -> Counter[str]:
    """Sends NUM_MESSAGES hostile messages over every subject; returns how many per subject kind."""
    r = f.rng
    sent: Counter[str] = Counter()
    trainer_id = next(actor_id for kind, actor_id in actors if kind == "trainer")
    heartbeats = Codec([WorkHeartbeat])
    weights, exhausted = Codec([WeightsPublished]), Codec([DataExhausted])
    stages = list(Stage)

    async def work() -> tuple[str, str, bytes]:
        stage = r.choice(stages)
        data = await f.typed(f.orders, f.order(stage)) if r.random() < 0.7 else f.garbage()
        return "reconciler", f"work.{stage.value}", data

    async def done() -> tuple[str, str, bytes]:
        stage = r.choice(stages)
        spoken_for = stage if r.random() < 0.7 else r.choice(stages)  # sometimes another stage's, on this subject
        data = await f.typed(f.completions, f.completion(spoken_for)) if r.random() < 0.7 else f.garbage()
        return STAGE_ROLE[stage], f"done.{stage.value}", data

    async def heartbeat() -> tuple[str, str, bytes]:
        stage = r.choice(stages)
        beat = WorkHeartbeat(stage, f.key(), r.choice([0, 1]), "fuzz", f.token())
        return STAGE_ROLE[stage], f"heartbeat.{stage.value}", await f.typed(heartbeats, beat)

    async def weights_signal() -> tuple[str, str, bytes]:
        msg = WeightsPublished(r.choice([f.run_name, "other"]), r.choice([1, 2, 10**9, -1]), f.key(), 0)
        return "trainer", f"weights.{f.run_name}", await f.typed(weights, msg)

    async def data_exhausted() -> tuple[str, str, bytes]:
        msg = DataExhausted(r.choice([f.run_name, "other"]), r.randrange(-1, 50))
        return "reconciler", f"data_exhausted.{f.run_name}", await f.typed(exhausted, msg)

    async def ctl() -> tuple[str, str, bytes]:
        verb = r.choice(SAFE_CTL_VERBS)
        target = r.choice([*actors, ("supervisor", ""), ("nobody", "x")])
        subject = control_subject(*target, verb) if target[1] else f"ctl.supervisor.{verb}"
        return OPERATOR, subject.rstrip("."), f.garbage()

    async def config_kv() -> tuple[str, str, bytes]:
        # never a value the schema accepts (what is valid is an operator's decision, not an attack):
        # wrong types, values out of range, values the reconciler's own check refuses, unknown and fixed keys
        key, values = r.choice(INVALID_CONFIG)
        return OPERATOR, f"$KV.config.{key}", r.choice([msgpack.packb(r.choice(values)), f.garbage()])

    async def registry_kv() -> tuple[str, str, bytes]:
        info = {"kind": "rollout", "state": "running", r.choice(["pid", "id", "host"]): f.value()}
        key = registration_key("rollout", f"rollout-9-{r.randrange(16**4):04x}")  # its own kind's: let through
        return "rollout", f"$KV.actors.{key}", r.choice([msgpack.packb(info, default=str), f.garbage()])

    async def denied() -> tuple[str, str, bytes]:  # another role's subject: the server must refuse
        role, subject = r.choice([("rollout", "work.train"), ("rollout", "done.train"), ("reward", "weights.x"),
                                  (OPERATOR, "$KV.slots.meta"), ("grouping", "$KV.config.trainer.lr"),
                                  ("trainer", f"data_exhausted.{f.run_name}"),
                                  ("rollout", f"$KV.actors.{registration_key('trainer', trainer_id)}"),
                                  ("reward", f"$KV.actors.{handover_key('trainer')}")])
        return role, subject, f.garbage()

    makers: list[tuple[Callable[[], Any], int]] = [(work, 25), (done, 30), (heartbeat, 5), (weights_signal, 8),
                                                   (data_exhausted, 2), (ctl, 10), (config_kv, 8),
                                                   (registry_kv, 8), (denied, 4)]
    choices = [m for m, w in makers for _ in range(w)]
    for i in range(NUM_MESSAGES):
        role, subject, data = await r.choice(choices)()
        sent[subject.split(".")[0] if not subject.startswith("$KV") else ".".join(subject.split(".")[:2])] += 1
        client = clients[role]
        if r.random() < 0.05:  # duplicated: the same message (and message id) twice
            msg_id = f"fuzz-{i}"
            await client.nc.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
            await client.nc.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        else:
            await client.nc.publish(subject, data)
        if i % 200 == 0:
            for c in clients.values():
                await c.nc.flush()
    for c in clients.values():
        await c.nc.flush()
    return sent


def trained_set(ledger: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each trained group and the samples it was trained with (asserting each was trained once)."""
    trained: dict[str, tuple[str, ...]] = {}
    for batch_id, batch in ledger["trained"].items():
        for group in batch["group_ids"]:
            assert group not in trained, f"group {group} trained twice (again in batch {batch_id})"
            trained[group] = tuple(sorted(s for s in batch["sample_ids"] if s.startswith(f"{group}-")))
    return trained


async def start_run(run_dir: Path, tmp_path: Path) -> LiveRun:
    """One small simulated run; the same seed and configuration every time."""
    SimConfig(rollout=StageSim(median_s=0.1, sigma=0.3, max_s=0.5), train=StageSim(median_s=0.8, sigma=0.1),
              seed=5).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=NUM_PROMPTS, num_slots=8, group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS, eta=1,
        stage_timeout_s=20.0))
    return await LiveRun(run_dir, cfg).start()


async def run_to_end(run: LiveRun, reconciler: dict[str, Any]) -> dict[str, Any]:
    """The trainer's ledger once the run has trained its last version."""
    assert run.bus is not None
    ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))

    async def finished() -> bool:
        status = await run.request(control_subject("reconciler", reconciler["id"], "status"), timeout=10.0)
        return status["finished"] and (await ledger.load())[0]["version"] == NUM_PROMPTS // BATCH_GROUPS

    await until(finished, 240, "the run to finish")
    return (await ledger.load())[0]


@pytest.mark.slow
async def test_fuzzing_every_subject_of_a_live_run(tmp_path: Path) -> None:
    undisturbed = await start_run(tmp_path / "undisturbed", tmp_path)
    try:
        (reconciler,) = await undisturbed.wait_actors("reconciler", 1)
        baseline = await run_to_end(undisturbed, reconciler)
    finally:
        assert await undisturbed.stop() == 0
    assert sorted(trained_set(baseline)) == sorted(f"e0-p{i}" for i in range(NUM_PROMPTS)), "all prompts, once"

    run = await start_run(tmp_path / "run", tmp_path)
    try:
        assert run.bus is not None and run.info is not None
        info = run.info
        (reconciler,) = await run.wait_actors("reconciler", 1)
        await run.wait_actors("trainer", 1)
        actors = [(a["kind"], a["id"]) for a in await run.actors()]
        for _ in range(5):  # without credentials nothing gets in at all
            with pytest.raises(Exception, match=r"(?i)authorization"):
                await connect_anonymously(info.nats_url)
        roles = ["reconciler", "rollout", "reward", "grouping", "trainer", OPERATOR]
        async with contextlib_all(info, roles) as clients:
            # random keys hit work in flight only by chance (a faster pipeline holds each key less long):
            # forge completions of the work in flight now, its key and attempt right, its token not; first,
            # while the run surely has work in flight (the fuzzing that follows may outlast the run)
            assert await forge_live_work(run, clients, Fuzzer(seed=12, run_name="")) > 0, "work was in flight"
            # other stages' completions, with the real (stolen) tokens, on done.rollout
            cross_stage = await forge_across_stages(run, clients)
            sent = await fuzz(clients, Fuzzer(seed=11, run_name=run.info.run), actors)
            assert sum(sent.values()) >= NUM_MESSAGES
            assert {"work", "done", "heartbeat", "weights", "data_exhausted", "ctl", "$KV.config",
                    "$KV.actors"} <= set(sent)
            denied = sum("permissions violation" in e.lower() for c in clients.values() for e in c.errors)
            assert denied >= 1, "another role's subjects are refused by the server"
            assert await clients["rollout"].refused("$kv.actors.reg.trainer."), "nobody writes a trainer's lease"

        state = await run_to_end(run, reconciler)
        assert trained_set(state) == trained_set(baseline), "the trained set of the undisturbed run"
        assert state["version"] == baseline["version"] and len(state["trained"]) == len(baseline["trained"])
        status = await run.request(control_subject("reconciler", reconciler["id"], "status"), timeout=10.0)
        assert status["trainer_version"] == state["version"]
        counters = status["lifecycle"]["counters"]
        assert counters.get("rejected_reports", 0) > 0 and counters.get("ignored_completions", 0) > 0, counters
        assert status["num_rejected_config"] > 0 and status["num_rejected_registrations"] > 0
        assert status["num_refused_senders"] >= cross_stage, "each completion on another stage's subject refused"
        refused = events(run.run_dir, "message_refused")
        assert {e["msg_type"] for e in refused} >= {"RewardDone", "StageFailed", "TrainDone"}, refused[:3]
        assert all(e.get("reason") for e in refused), "each refusal says why"
        dead = await run.bus.js.stream_info("DLQ")
        assert dead.state.messages > 100, "undecodable messages are dead letters"
        assert not events(run.run_dir, "actor_crashed"), "no actor crashed"
        assert not events(run.run_dir, "bus_permission_denied"), "every actor's own subjects are declared"
        assert all(e.get("reason") for e in events(run.run_dir, "report_rejected"))
        supervisor = await run.request("ctl.supervisor.status")
        assert supervisor["outcome"] == "running" and len(supervisor["actors"]) == len(actors)
        assert supervisor["num_refused_finishes"] > 0, "fuzzed finishes reached the supervisor and were refused"
    finally:
        assert await run.stop() == 0


async def forge_live_work(run: LiveRun, clients: dict[str, RoleClient], f: Fuzzer, wanted: int = 5) -> int:
    """Completions naming rollouts and rewards in flight, their key and attempt right, their token not: each
    sent as the slots bucket shows the work issued (a watch), until ``wanted`` are sent (or 60 s pass)."""
    assert run.bus is not None
    completions = Codec(COMPLETION_TYPES)
    forged = 0
    entries = run.bus.kv_watch("slots")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60), contextlib.aclosing(entries):
            async for entry in entries:
                if entry is None or entry.deleted or not entry.key.startswith(SLOT_PREFIX):
                    continue
                slot = Slot.decode(entry.value)
                stage = {SlotState.ROLLOUT: Stage.ROLLOUT, SlotState.REWARD: Stage.REWARD}.get(slot.state)
                if stage is None:
                    continue
                wrong = f.token()
                msg = (RolloutDone(slot.sample_id, slot.attempt, "forged", 0, 0, wrong) if stage is Stage.ROLLOUT
                       else RewardDone(slot.sample_id, slot.attempt, "forged", wrong))
                await clients[STAGE_ROLE[stage]].js_publish(f"done.{stage.value}", await completions.encode(msg))
                forged += 1
                if forged >= wanted:
                    break
    return forged


async def forge_across_stages(run: LiveRun, clients: dict[str, RoleClient]) -> int:
    """Cross-stage forgeries, sent as the rollout role (which may publish only on ``done.rollout``) with the
    tokens the table really issued (read from the ``slots`` bucket: a stolen token): a `RewardDone` of a sample
    in reward, and a `StageFailed(train)` and a `TrainDone` naming the version two ahead, of the batch in
    training. Each must be refused for its subject, whatever its token. Returns how many were sent."""
    assert run.bus is not None
    completions = Codec(COMPLETION_TYPES)
    sent: set[str] = set()

    async def send(msg: Any) -> None:
        assert await clients["rollout"].js_publish("done.rollout", await completions.encode(msg))
        sent.add(type(msg).__name__)

    async def forged_all() -> bool:
        slots = [Slot.decode(e.value) for k in await run.bus.kv_keys("slots") if k.startswith(SLOT_PREFIX)
                 and (e := await run.bus.kv_get("slots", k)) is not None]
        meta_entry = await run.bus.kv_get("slots", META_KEY)
        meta = MetaRecord.decode(meta_entry.value) if meta_entry is not None else MetaRecord()
        if "RewardDone" not in sent and (rewarding := [s for s in slots if s.state is SlotState.REWARD]):
            s = rewarding[0]
            await send(RewardDone(s.sample_id, s.attempt, "forged", s.token))
        members = [s for g in meta.batch_group_ids for s in sorted(
            (s for s in slots if s.state is SlotState.TRAIN and s.group_id == g), key=lambda s: s.index_in_group)]
        if "TrainDone" not in sent and members and meta.batch_id:  # the batch's order: its first member's token
            attempt, token = max(s.attempt for s in members), members[0].token
            await send(StageFailed(Stage.TRAIN, meta.batch_id, attempt, "spoof", token))
            await send(TrainDone(meta.batch_id, attempt, meta.trainer_version + 2, token))
        return len(sent) == 3

    await until(forged_all, 60, "a sample in reward and a batch in training to forge completions of")
    return 3


def contextlib_all(info: Any, roles: list[str]) -> Any:
    """One connection per role, as an async context manager of {role: client}."""

    @contextlib.asynccontextmanager
    async def opened() -> Any:
        async with contextlib.AsyncExitStack() as stack:
            yield {role: await stack.enter_async_context(connect_as(info, role)) for role in roles}

    return opened()
