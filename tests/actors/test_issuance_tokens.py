"""Completions bound to what was issued: the lifecycle core accepts a report only with the order's token.

Each test forges what a client on the bus could send without having seen the order (right key, stage
and attempt, any token; or an attempt the table never issued), checks that the core rejects it,
counts it and says why, and that the run then goes on exactly as without the forgery.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from structlog.testing import capture_logs

from actors import GroupOrder, RewardOrder, RolloutOrder, SlotState, Stage, StageFailed, TrainDone, TrainOrder
from tests.actors.test_lifecycle import deliver, run_all, start

pytestmark = pytest.mark.usefixtures("quiet_logs")
QUIET_LOGS_LEVEL = logging.WARNING

FORGED = "forged-token-000"




async def _until(core, world, kind: type):
    """Deliver orders until one of `kind` is pending; returns it."""
    while not any(isinstance(o, kind) for o in world.pending):
        await deliver(core, world, next(o for o in world.pending if not isinstance(o, kind)))
    return next(o for o in world.pending if isinstance(o, kind))


def _forge(done, **changes):
    return dataclasses.replace(done, **{"token": FORGED, **changes})


async def _assert_rejected(core, forged, now: float = 1.0) -> None:
    before = core.snapshot(now).counters.get("rejected_reports", 0)
    slots_before = core.slots
    with capture_logs() as logs:
        assert await core.on_completion(forged, now) == []
    assert core.slots == slots_before, "a rejected report changes nothing"
    assert core.snapshot(now).counters.get("rejected_reports", 0) == before + 1
    (event,) = [e for e in logs if e["event"] == "report_rejected"]
    assert event["stage"] == forged.STAGE.value if not isinstance(forged, StageFailed) else forged.stage.value
    assert event["reason"] in ("token does not match the issued one", "attempt never issued")


@pytest.mark.parametrize("kind", [RolloutOrder, RewardOrder, GroupOrder, TrainOrder])
async def test_forged_completion_of_every_stage_is_rejected(kind: type) -> None:
    _, resumed, world = await start(num_prompts=2)
    core = resumed.lifecycle
    order = await _until(core, world, kind)
    assert order.token and len(order.token) >= 16 and order.token in order.msg_id
    real = world.complete(order)
    await _assert_rejected(core, _forge(real))
    await _assert_rejected(core, _forge(real, attempt=order.attempt + 1))
    await _assert_rejected(core, StageFailed(order.STAGE, order.key, order.attempt, "spoof", FORGED))
    await run_all(core, world)  # the real completions still count: the run ends as without forgeries
    assert core.is_finished and core.trainer_version == 1
    assert world.trainer.trained_groups == {"e0-p0", "e0-p1"}


async def test_train_done_with_a_future_attempt_does_not_free_the_batch() -> None:
    """A spoof: done.train for the batch in training with attempt 50 must not mark it trained."""
    _, resumed, world = await start(num_prompts=4)
    core = resumed.lifecycle
    batch = await _until(core, world, TrainOrder)
    spoof = TrainDone(batch.batch_id, 50, 7)  # no token at all, as a client that never saw the order
    assert await core.on_completion(spoof, 1.0) == []
    assert core.trainer_version == 0, "the version does not jump to the spoof's"
    assert {s.state for s in core.slots if s.batch_id == batch.batch_id} == {SlotState.TRAIN}
    assert core.snapshot(1.0).counters["rejected_reports"] == 1
    await deliver(core, world, batch)  # the trainer's real completion is accepted
    assert core.trainer_version == 1 and not any(s.batch_id == batch.batch_id for s in core.slots)
    await run_all(core, world)
    assert core.is_finished and core.trainer_version == world.trainer.version == 2


async def test_heartbeat_without_the_token_keeps_nothing_alive() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    order = world.pending[0]
    core.on_heartbeat(Stage.ROLLOUT, order.key, order.attempt, "spoofer", 9.0, FORGED)
    assert core.snapshot(9.0).counters["rejected_reports"] == 1
    retried = await core.tick(11.0)  # the forged heartbeat did not push the timeout back
    assert any(o.key == order.key and o.attempt == order.attempt + 1 for o in retried)
    core.on_heartbeat(Stage.ROLLOUT, order.key, order.attempt, "late", 12.0, order.token)  # superseded: ignored
    assert core.snapshot(12.0).counters["rejected_reports"] == 1


async def test_the_real_heartbeat_keeps_work_alive() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    order = world.pending[0]
    core.on_heartbeat(Stage.ROLLOUT, order.key, order.attempt, "rollout-1", 9.0, order.token)
    retried = await core.tick(11.0)
    assert not any(o.key == order.key for o in retried)


async def test_every_attempt_gets_a_fresh_token_recorded_with_the_slot() -> None:
    _, resumed, world = await start()
    core = resumed.lifecycle
    order = world.pending[0]
    slot = next(s for s in core.slots if s.sample_id == order.key)
    assert slot.token == order.token
    (retry,) = [o for o in await core.tick(11.0) if o.key == order.key]
    assert retry.token != order.token and retry.msg_id != order.msg_id
    assert next(s for s in core.slots if s.sample_id == order.key).token == retry.token
    tokens = {o.token for o in world.pending}
    assert len(tokens) == len(world.pending), "no two orders share a token"


@pytest.mark.parametrize("token", ["tökén-ünicode-✓", "\x00" * 16, "x" * 10_000])
async def test_a_token_of_any_characters_is_refused_without_breaking_the_core(token: str) -> None:
    """compare_digest raises on str with non-ASCII characters: a forged token must not break the core."""
    _, resumed, world = await start(num_prompts=2)
    core = resumed.lifecycle
    order = world.pending[0]
    await _assert_rejected(core, _forge(world.complete(order), token=token))
    core.on_heartbeat(Stage.ROLLOUT, order.key, order.attempt, "x", 1.0, token)
    await run_all(core, world)  # the core is not broken: the run goes on
    assert core.is_finished
