"""Spoofed bus messages against a live run (real reconciler, simulated stages, real nats-server with auth).

Each attack is made three ways where they differ: with no credentials (the server refuses the
connection), with another role's credentials (the server refuses the subject), and with the right
role's credentials but a forged token or a false claim (the receiver refuses it, counts it and says
why). The run must end exactly as an undisturbed one: every prompt's group trained once, the
reconciler's version the trainer's, no actor crashed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import nats.errors
import pytest

from actors.messages import COMPLETION_TYPES, DataExhausted, WeightsPublished, all_order_types
from actors.reconciler.store import META_KEY
from actors.reconciler.work import MetaRecord, RolloutDone, TrainDone, TrainOrder
from runtime.bus_auth import OPERATOR, control_subject
from runtime.codec import Codec
from runtime.registry import handover_key, registration_key
from tests.integration.bus_clients import connect_anonymously, connect_as
from tests.integration.harness import LiveRun, write_config
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS, GROUP_SIZE, BATCH_GROUPS = 24, 2, 2


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for path in (run_dir / "logs").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if f'"{name}"' in line:
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
    return found


async def start_run(tmp_path: Path) -> LiveRun:
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.1, sigma=0.3, max_s=0.5), train=StageSim(median_s=1.0, sigma=0.1),
              seed=3).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=NUM_PROMPTS, num_slots=8, group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS, eta=1,
        stage_timeout_s=20.0))
    return await LiveRun(run_dir, cfg).start()


async def reconciler_status(run: LiveRun) -> dict[str, Any]:
    (reconciler,) = await run.wait_actors("reconciler", 1)
    return await run.request(control_subject("reconciler", reconciler["id"], "status"))


async def test_spoofs_on_a_live_run_are_refused_and_the_run_ends_as_undisturbed(tmp_path: Path) -> None:
    run = await start_run(tmp_path)
    try:
        assert run.bus is not None and run.info is not None
        info, bus = run.info, run.bus
        completions, orders = Codec(COMPLETION_TYPES), Codec(all_order_types())
        run_name = run.info.run

        # no credentials: the server refuses the connection itself
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await connect_anonymously(info.nats_url)

        async with (connect_as(info, "rollout") as rollout, connect_as(info, "trainer") as trainer,
                    connect_as(info, OPERATOR) as operator, connect_as(info, "reconciler") as reconciler,
                    connect_as(info, "reward") as reward):
            # 1. pre-empting a completion's predictable Nats-Msg-Id (the right role, no token), for prompts
            # admitted later (the table holds 4 groups at once): their real completions must still count
            await run.wait_actors("reconciler", 1)
            for i in range(8, 16):
                for j in range(GROUP_SIZE):
                    sample = f"e0-p{i}-s{j}"
                    forged = await completions.encode(RolloutDone(sample, 0, "forged/key", 0, 0))
                    assert await rollout.js_publish("done.rollout", forged, msg_id=f"done.rollout.{sample}.0"), \
                        rollout.errors
            assert not await reward.js_publish("done.rollout", forged, msg_id="done.rollout.e0-p16-s0.0", timeout=1)
            assert await reward.refused("done.rollout"), "another stage's role cannot report rollouts"

            # 2. done.train for the batch in training with attempt 50
            slots = await bus.kv("slots")

            async def batch_in_training() -> str:
                return MetaRecord.decode((await slots.get(META_KEY)).value).batch_id

            batch_id = await until(batch_in_training, 60, "a batch in training")
            spoof = await completions.encode(TrainDone(batch_id, 50, 10**6))
            forged_token = await completions.encode(TrainDone(batch_id, 0, 10**6, "0" * 16))
            assert await trainer.js_publish("done.train", spoof), "the trainer's role may; the reconciler decides"
            assert await trainer.js_publish("done.train", forged_token)
            assert not await rollout.js_publish("done.train", spoof), "another role cannot complete training"
            assert await rollout.refused("done.train")

            # 3. a made-up batch id naming an already-trained group
            ledger = TrainerLedger(await bus.kv(LEDGER_BUCKET))

            async def first_trained() -> dict[str, Any]:
                return next(iter((await ledger.load())[0]["trained"].items()), None)

            trained_batch, record = await until(first_trained, 60, "a trained batch")
            group_keys = tuple(f"sim/groups/{g}/a0" for g in record["group_ids"])
            made_up = TrainOrder("b-made-up", 0, tuple(record["group_ids"]), group_keys, tuple(record["sample_ids"]),
                                 0, 10**6, "whatever")
            data = await orders.encode(made_up)
            assert not await rollout.js_publish("work.train", data), "only the reconciler issues work"
            assert await rollout.refused("work.train")
            assert await reconciler.js_publish("work.train", data)  # its role may: the trainer's ledger decides

            # 4. weights announcing version 10^9
            announcement = await Codec([WeightsPublished]).encode(WeightsPublished(run_name, 10**9, "k", 0))
            await rollout.publish(f"weights.{run_name}", announcement)
            assert await rollout.refused("weights."), "only the trainer announces weights"
            await trainer.publish(f"weights.{run_name}", announcement)

            # 5. data_exhausted naming version 2
            claim = await Codec([DataExhausted]).encode(DataExhausted(run_name, 2))
            await trainer.publish(f"data_exhausted.{run_name}", claim)
            assert await trainer.refused("data_exhausted."), "only the reconciler says the data ran out"

            # 6. a registry entry shaped like a registration, under the rollout role's own keys
            shaped = msgpack.packb({"kind": "rollout", "state": "running"})
            forged_key = registration_key("rollout", "rollout-9-beef")
            await operator.publish(f"$KV.actors.{forged_key}", shaped)
            assert await operator.refused("$kv.actors"), "operator tools do not register actors"
            await rollout.publish(f"$KV.actors.{forged_key}", shaped)
            # ... and over another kind's: a rollout actor neither overwrites nor deletes a trainer's
            # lease, nor leaves it a handover, nor listens to (and answers) the trainer's control requests
            (trainer_actor,) = await run.wait_actors("trainer", 1)
            trainer_key = registration_key("trainer", trainer_actor["id"])
            registry = await bus.kv("actors")
            before = await registry.get(trainer_key)
            stolen = msgpack.packb({**msgpack.unpackb(before.value), "state": "stopped"})
            assert not await rollout.js_publish(f"$KV.actors.{trainer_key}", stolen, timeout=1.0)
            assert await rollout.refused(f"$kv.actors.{trainer_key}")
            registry_as_rollout = await rollout.nc.jetstream().key_value("actors")
            with pytest.raises((TimeoutError, nats.errors.Error)):  # refused: never acknowledged
                await registry_as_rollout.delete(trainer_key)
            # under its own prefix it may delete anything, and a key naming the trainer is no trainer's lease
            await registry_as_rollout.delete(registration_key("rollout", trainer_actor["id"]))
            assert not await rollout.js_publish(f"$KV.actors.{handover_key('trainer')}", b"x", timeout=1.0)
            await rollout.nc.subscribe(control_subject("trainer", trainer_actor["id"]))
            assert await rollout.refused(f"ctl.trainer.{trainer_actor['id']}"), "no one answers for a trainer"
            after = await registry.get(trainer_key)
            assert msgpack.unpackb(after.value)["state"] == "running" and after.revision >= before.revision
            assert not [k for k in await registry.keys() if k == handover_key("trainer")]

            # 7. well-typed garbage in the config bucket
            garbage = msgpack.packb(1)  # max_ready_groups=1 < batch_size_groups: no batch could ever form
            await rollout.publish("$KV.config.reconciler.scheduling.max_ready_groups", garbage)
            assert await rollout.refused("$kv.config"), "actors only read the live configuration"
            await operator.publish("$KV.config.reconciler.scheduling.max_ready_groups", garbage)

            # subscribing to another role's traffic is refused as well
            await rollout.nc.subscribe("done.>")
            assert await rollout.refused("done.>")

        async def finished() -> bool:
            return (await ledger.load())[0]["version"] == NUM_PROMPTS // BATCH_GROUPS and (
                (await reconciler_status(run))["finished"])

        await until(finished, 120, "the run to train every prompt")
        state = (await ledger.load())[0]
        groups = [g for b in state["trained"].values() for g in b["group_ids"]]
        assert sorted(groups) == sorted(f"e0-p{i}" for i in range(NUM_PROMPTS)), "every group trained once"
        assert "b-made-up" not in state["trained"] and trained_batch in state["trained"]
        status = await reconciler_status(run)
        assert status["trainer_version"] == state["version"], "the version did not jump to a spoof's"
        counters = status["lifecycle"]["counters"]
        assert counters["rejected_reports"] >= 2, counters  # done.train with attempt 50, and with a forged token
        assert counters.get("retries", 0) == 0, "no real completion was lost to a pre-empted message id"
        assert status["num_rejected_registrations"] >= 1
        assert {e["reason"] for e in events(run.run_dir, "report_rejected")} >= {
            "token does not match the issued one", "attempt never issued"}
        assert any(e["key"] == "reg.rollout.rollout-9-beef" for e in events(run.run_dir, "registry_entry_rejected"))
        assert any("no batch could ever form" in e["error"] for e in events(run.run_dir, "config_change_rejected"))
        assert any(e.get("version") == 10**9 for e in events(run.run_dir, "weights_signal_rejected"))
        assert not events(run.run_dir, "actor_crashed"), "no actor crashed"
        assert not events(run.run_dir, "bus_permission_denied"), "every actor's own subjects are declared"
        assert not [e for e in events(run.run_dir, "actor_lost") if e.get("actor_id") == trainer_actor["id"]]
    finally:
        assert await run.stop() == 0
