"""A spoof: the evaluator's role sending ``ctl.supervisor.finish`` at version 2 of 10, with no final evaluation,
must not end the run as finished. A finish is believed only when the durable state agrees: the version it names
trained (the reconciler's table), the last one (``run.steps``, or the data run out), its evaluation stored.

A live simulated run (real supervisor, real reconciler, real nats-server with auth) and the evaluator's real
check behind a model-less evaluator kind (`SimEvaluatorActor`); the requests are sent with the evaluator's
credentials, as whoever holds them could."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from actors.reconciler.kv_store import KVSlotStore
from actors.reconciler.store import META_KEY
from actors.reconciler.work import MetaRecord
from runtime.blob import open_store
from runtime.metrics_log import numbered, write_metrics
from runtime.supervisor import FINISH_SUBJECT
from tests.integration.bus_clients import connect_as
from tests.integration.harness import LiveRun, write_config
from tests.integration.sim_stages import SimConfig, StageSim, sim_run_toml
from tests.integration.test_bus_trust import events
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS, GROUP_SIZE, BATCH_GROUPS, STEPS = 24, 2, 2, 10

EVALUATOR_TOML = f"""
[run]
steps = {STEPS}
[actors.evaluator]
entry = "tests.integration.sim_stages:SimEvaluatorActor"
"""


async def test_a_finish_is_believed_only_when_the_table_and_the_metrics_agree(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.1, sigma=0.3, max_s=0.5), train=StageSim(median_s=0.6, sigma=0.1),
              seed=7).write(run_dir)
    base = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=NUM_PROMPTS, num_slots=8, group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS, eta=1,
        stage_timeout_s=20.0))
    run = await LiveRun(run_dir, [base, write_config(tmp_path / "evaluator.toml", EVALUATOR_TOML)]).start()
    try:
        assert run.bus is not None and run.info is not None
        table = KVSlotStore(run.bus, "slots")

        async def trained_version() -> int:
            # the reconciler's table, which the finish check reads: the trainer's own ledger runs ahead of it
            entry = await table.get(META_KEY)
            return MetaRecord.decode(entry.value).trainer_version if entry is not None else 0

        async with connect_as(run.info, "evaluator") as evaluator:
            async def finish(**body: Any) -> dict[str, Any]:
                reply = await evaluator.nc.request(FINISH_SUBJECT, msgpack.packb(body), timeout=40)
                return msgpack.unpackb(reply.data, raw=False)

            await until(lambda: _at_least(trained_version, 2), 120, "version 2 trained")
            refusals = [
                (await finish(by="spoof", reason="spoof", version=2), "short of run.steps=10"),  # the spoof above
                (await finish(by="spoof", reason="spoof"), "names no version"),
                (await finish(by="spoof", reason="spoof", version=True), "names no version"),
                (await finish(by="spoof", reason="steps", version=STEPS), "is not trained"),
                (await finish(by="spoof", reason="steps", version=10**9), "is not trained"),
            ]
            for reply, why in refusals:
                assert not reply["ok"] and why in reply["error"], (why, reply)
            status = await run.request("ctl.supervisor.status")
            assert status["outcome"] == "running" and status["num_refused_finishes"] == len(refusals)

            # version 10 trained, its evaluation not stored: still refused; stored: believed
            await until(lambda: _at_least(trained_version, STEPS), 180, f"version {STEPS} trained")
            reply = await finish(by="evaluator", reason="steps", version=STEPS)
            assert not reply["ok"] and "no evaluation of version 10" in reply["error"], reply
            store = open_store(run.info.storage_url)
            try:
                await write_metrics(store, "eval", numbered(STEPS), {"version": STEPS, "pass_at_1": 0.5})
            finally:
                await store.close()
            assert (await finish(by="evaluator", reason="steps", version=STEPS))["ok"]
        assert run.proc is not None
        await until(lambda: run.proc.poll() is not None, 120, "the finished run to stop")
        assert run.proc.returncode == 0
        refused = events(run.run_dir, "run_finish_refused")
        assert len(refused) == len(refusals) + 1 and all(e["why"] for e in refused)
        assert [e["version"] for e in events(run.run_dir, "run_finish_requested")] == [STEPS]
        assert any(e.get("outcome") == "finished" for e in events(run.run_dir, "supervisor_stopped"))
    finally:
        assert await run.stop() == 0


async def _at_least(version_of: Any, version: int) -> bool:
    return await version_of() >= version
