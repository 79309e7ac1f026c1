"""A long(ish) run's storage stays bounded: the real reconciler collects the blobs of finished groups.

The simulated stages write their records where the real ones do (``samples/<id>/a<n>/...``,
``groups/<id>/a<n>``); 160 prompts in groups of 4 write 1440 blobs or more (retries write more). The number
of them in the store at any moment stays below what the live groups and the retention window hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.reconciler.kv_store import KVSlotStore
from actors.reconciler.slot import Slot, SlotState
from actors.reconciler.store import CURSOR_KEY, SLOT_PREFIX
from actors.reconciler.task_cursor import CursorRecord
from runtime.blob import open_store
from tests.integration.harness import LiveRun, write_config
from tests.integration.sim_stages import SimConfig, StageSim, sim_run_toml
from tests.waiting import until

pytestmark = pytest.mark.timeout(400)

NUM_PROMPTS, GROUP_SIZE, BATCH_GROUPS, ETA, RETENTION = 160, 4, 4, 1, 2
FILES_PER_GROUP = 1 + 2 * GROUP_SIZE  # a group record; a trajectory and a reward record per sample
FINAL_BOUND = (RETENTION + 1) * BATCH_GROUPS * FILES_PER_GROUP * 2  # after the run: retained batches, x2 retries


async def test_the_blobs_of_finished_groups_are_collected_and_storage_stays_bounded(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.05, sigma=0.5, max_s=0.3, error_rate=0.02)).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=NUM_PROMPTS, num_slots=64, group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS, eta=ETA,
        stage_timeout_s=30.0))
    run = await LiveRun(run_dir, cfg, "--set", f"reconciler.blob_retention_versions={RETENTION}").start()
    counts: list[int] = []
    try:
        assert run.bus is not None
        slots = KVSlotStore(run.bus, "slots")
        async with open_store((run_dir / "blobs").as_uri()) as store:

            async def num_blobs() -> int:
                return len(await store.list("samples/")) + len(await store.list("groups/"))

            async def finished() -> bool:  # counting the blobs at each look
                counts.append(await num_blobs())
                entry = await slots.get(CURSOR_KEY)  # None until the reconciler has started
                cursor = CursorRecord.decode(entry.value) if entry is not None else CursorRecord(0, 0)
                states = [Slot.decode((await slots.get(k)).value).state for k in await slots.keys()
                          if k.startswith(SLOT_PREFIX)]
                return cursor.position == NUM_PROMPTS and all(s is SlotState.EMPTY for s in states)

            await until(finished, 300, "the run to finish", every_s=0.5)

            async def retired() -> tuple[int] | None:  # the last batches' blobs go after the run's end
                count = await num_blobs()
                return (count,) if count <= FINAL_BOUND else None

            (final,) = await until(retired, 60, f"at most {FINAL_BOUND} blobs left after the run")
    finally:
        assert await run.stop() == 0
    # live groups are at most (eta + 1) * B; the retention keeps RETENTION more versions' batches
    bound = ((ETA + 1) * BATCH_GROUPS + (RETENTION + 1) * BATCH_GROUPS) * FILES_PER_GROUP * 2  # x2: retried attempts
    written = NUM_PROMPTS * FILES_PER_GROUP
    print(f"blobs: max {max(counts)} during the run, {final} at the end, of >= {written} written; bound {bound}")
    assert max(counts) <= bound < written / 3  # (the end's bound is the wait for `retired` above)
