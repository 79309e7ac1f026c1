"""A group's rollout (reward) orders travel as one message and come back as one group completion.

The wire form must not change what the core decides: every item keeps its own attempt and issuance
token, a group completion is applied item by item in one core call, and a forged or stale item is
rejected (counted) without touching the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from actors import RewardOrder, RolloutOrder, SlotState, Stage, StageFailed
from actors.messages import COMPLETION_TYPES, all_order_types
from actors.reconciler.work import (
    GroupOrder,
    RewardGroupOrder,
    RolloutGroupDone,
    RolloutGroupOrder,
    group_done,
    group_orders,
)
from runtime.codec import Codec
from tests.actors.test_lifecycle import run_all, start

pytestmark = pytest.mark.usefixtures("quiet_logs")
QUIET_LOGS_LEVEL = logging.WARNING




def _rollout(sample: str, group: str, token: str, attempt: int = 0) -> RolloutOrder:
    return RolloutOrder(sample, attempt, "p", group, int(sample[-1]), 0, token)


def test_group_orders_bundles_each_groups_sample_orders_and_keeps_the_rest() -> None:
    train_like = GroupOrder("g9", 0, "p", ("g9-s0",), ("r",), "tg")
    reward = RewardOrder("g2-s0", 1, "p", "g2", "k", "tr")
    orders = [_rollout("g1-s0", "g1", "a"), train_like, _rollout("g2-s0", "g2", "b"), reward,
              _rollout("g1-s1", "g1", "c")]
    wire = group_orders(orders)
    assert [type(o) for o in wire] == [RolloutGroupOrder, GroupOrder, RolloutGroupOrder, RewardGroupOrder]
    assert [i.sample_id for i in wire[0].items] == ["g1-s0", "g1-s1"] and wire[1] is train_like
    assert wire[3].items == (reward,)
    # the id depends on every item's token: a re-issue (new tokens) is a new message, a re-publish is not
    assert wire[0].msg_id == group_orders(orders)[0].msg_id
    retoken = group_orders([_rollout("g1-s0", "g1", "x"), _rollout("g1-s1", "g1", "c")])[0]
    assert retoken.msg_id != wire[0].msg_id


def test_group_messages_round_trip_through_the_codec() -> None:
    order = group_orders([_rollout("g1-s0", "g1", "a"), _rollout("g1-s1", "g1", "b")])[0]
    failed = StageFailed(Stage.ROLLOUT, "g1-s1", 0, "refused", "b")
    done = group_done(order, [dataclasses.replace(_done(order.items[0]), token="a"), failed])

    async def round_trip():
        orders, completions = Codec(all_order_types()), Codec(COMPLETION_TYPES)
        return (await orders.decode(await orders.encode(order)),
                await completions.decode(await completions.encode(done)))

    assert asyncio.run(round_trip()) == (order, done)
    assert done.events == (done.done[0], failed)


def _done(order: RolloutOrder):
    from actors import RolloutDone

    return RolloutDone(order.sample_id, order.attempt, f"t/{order.sample_id}", 0, 0, order.token)


async def test_a_group_completion_applies_each_item_and_rejects_a_forged_one_alone() -> None:
    _, resumed, world = await start(num_prompts=2)
    core = resumed.lifecycle
    wire = group_orders(list(world.pending))
    first = next(o for o in wire if isinstance(o, RolloutGroupOrder))
    results = [world.complete(item) for item in first.items]
    results[1] = dataclasses.replace(results[1], token="forged-token-000")  # one item forged
    done = group_done(first, results)
    assert isinstance(done, RolloutGroupDone)
    orders = await core.on_completions(done.events, 1.0)
    moved = {s.sample_id for s in core.slots if s.state is SlotState.REWARD}
    assert moved == {i.sample_id for i in first.items} - {first.items[1].sample_id}
    assert core.snapshot(1.0).counters["rejected_reports"] == 1
    assert {o.sample_id for o in orders} == moved and all(isinstance(o, RewardOrder) for o in orders)
    assert await core.on_completions(done.events, 1.0) == [], "a redelivered group completion changes nothing"
    # the forged item's sample is still waited for with its real token; the run ends as without the forgery
    for item in first.items:
        if item.sample_id not in moved:
            continue
        world.pending.remove(item)
    world.add(orders, core.scheduling.eta)
    await run_all(core, world)
    assert core.is_finished and world.trainer.trained_groups == {"e0-p0", "e0-p1"}
