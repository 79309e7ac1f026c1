"""Poison messages on every work and done subject of a live run (the real reconciler, the simulated
stages): each is dead-lettered with its reason, no actor crashes, and the run finishes by itself."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgpack
import pytest

from actors.messages import ORDER_TYPES
from actors.reconciler.slot import SlotState, Stage
from tests.integration.harness import LiveRun, write_config
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
from tests.integration.test_bus_outage import _assert_clean_exit, _events
from tests.integration.test_reconciler import _durable_table, _num_trained_groups, _trained
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)


def _poisons(type_name: str) -> dict[str, bytes]:
    """Three envelopes no receiver can decode, by the reason they are dead-lettered for."""
    head = {"schema": 1, "v": 1}
    return {
        "unknown_type": msgpack.packb({**head, "type": [type_name], "body": msgpack.packb({})}),
        "invalid_blob_key": msgpack.packb({**head, "type": type_name, "blob": "../../etc/passwd"}),
        "invalid": msgpack.packb({**head, "type": type_name, "body": msgpack.packb({"nope": 1})}),
    }


@pytest.mark.slow
async def test_poison_on_every_work_and_done_subject_is_dead_lettered_and_the_run_finishes(tmp_path: Path) -> None:
    num_prompts = 64
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.05, sigma=0.5, max_s=0.5), reward=StageSim(median_s=0.02, max_s=0.2),
              group=StageSim(median_s=0.02, max_s=0.2), train=StageSim(median_s=0.05, max_s=0.3), seed=5).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=num_prompts, num_slots=48, group_size=4, batch_groups=4, eta=2,
        rollout_count=1, reward_count=1, stage_timeout_s=20.0))
    run = await LiveRun(run_dir, cfg).start()
    try:
        assert run.bus is not None
        ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))

        async def started() -> bool:
            return await _num_trained_groups(ledger) >= 8

        await until(started, 120, "the first batches trained", every_s=0.5)
        expected: Counter[tuple[str, str]] = Counter()
        for stage in Stage:
            for subject, type_name in ((f"work.{stage.value}", ORDER_TYPES[stage][0]),
                                       (f"done.{stage.value}", f"done.{stage.value}")):
                for reason, data in _poisons(type_name).items():
                    await run.bus.js.publish(subject, data)
                    expected[(subject, reason)] += 1

        async def finished() -> bool:
            cursor, slots, _ = await _durable_table(run.bus)
            return cursor.position == num_prompts and all(s.state is SlotState.EMPTY for s in slots)

        await until(finished, 180, "every prompt trained or dropped with poison in every queue", every_s=1.0)
        dlq = await run.bus.js.subscribe("dlq.>", ordered_consumer=True, deliver_policy=None)
        letters: Counter[tuple[str, str]] = Counter()
        for _ in range(sum(expected.values())):
            m = await dlq.next_msg(timeout=10)
            letters[(m.headers["subject"], m.headers["Reason"])] += 1
        assert letters == expected
        groups = [g for b in (await _trained(ledger))["trained"].values() for g in b["group_ids"]]
        assert len(groups) == len(set(groups)) and len(groups) >= 0.9 * num_prompts
    finally:
        rc = await run.stop()
    assert rc == 0
    _assert_clean_exit(run_dir, run.output())
    assert len(_events(run_dir, "message_dead_lettered")) == sum(expected.values())
