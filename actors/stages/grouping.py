"""The grouping actor: turn a prompt's G rewarded samples into a training-ready group checkpoint.

Advantages are Dr. GRPO's: reward minus the group mean, no std normalisation. A sample is a chain of
segments (actors.agent.episode: self-summarization); its reward grades the chain's final workspace once, so
the group's advantages are one per chain, over the chains of the prompt, and the learner gives a chain's
advantage to every policy token of every segment, its summaries included. The checkpoint holds each
sample's segments (tokens, loss mask, behaviour log-probs, per-token policy versions, router choices), reward
components and advantage, tagged with the group's min/max policy version.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import structlog

from actors._stage import StageActor, WorkRefused
from actors.reconciler.slot import Stage
from actors.reconciler.work import GroupDone, GroupOrder
from actors.records import GroupRecord, GroupSample, RewardRecord, RolloutRecord
from runtime.actor import Delivery

log = structlog.get_logger(__name__)

__all__ = ["GroupingActor", "dr_grpo_advantages", "group_advantages"]


def dr_grpo_advantages(rewards: Sequence[float]) -> list[float]:
    """Reward minus the group mean (Dr. GRPO: no division by the group's std), in float64, without torch:
    the grouping process loads none (tests/test_import_graph.py).

    The mean is `statistics.fmean` (the exactly rounded sum, divided by the count): the same on every
    machine. torch's float64 sum (what grouping used before) adds in an order that depends on the
    CPU's vector width, so the two agree bit for bit whenever every partial sum is exact in float64 (rewards
    on a binary grid: 0, 0.25, 1, ...) and otherwise within a few ulps of the mean
    (tests/actors/test_group_advantages.py). A group whose rewards are all equal gets exactly 0 (not a
    rounding residue of the mean), so a sample without a learning signal is recognised by ``advantage == 0``.
    Finite rewards only: `group_advantages` refuses the others.
    """
    if len(set(rewards)) <= 1:
        return [0.0] * len(rewards)
    mean = statistics.fmean(rewards)
    return [r - mean for r in rewards]


def group_advantages(group_id: str, rewards: Sequence[RewardRecord]) -> list[float]:
    """The Dr. GRPO advantage of each of a group's samples.

    Raises:
        WorkRefused: a reward is NaN or infinite, naming its samples: no advantage of the group means anything
            then (``[-inf, -inf]`` would pass for a group without signal), so the group is not trained.
    """
    bad = {r.sample_id: r.reward for r in rewards if not math.isfinite(r.reward)}
    if bad:
        raise WorkRefused(f"group {group_id}: non-finite rewards {bad}; the group is not trained. The reward "
                          "actor's components say which term made them (check the reward section's coefficients)")
    return dr_grpo_advantages([r.reward for r in rewards])


class GroupingActor(StageActor):
    stage = Stage.GROUP

    async def work(self, order: GroupOrder, delivery: Delivery) -> GroupDone:
        if len(order.sample_ids) != len(order.reward_keys) or not order.sample_ids:
            raise WorkRefused(f"group {order.group_id}: {len(order.sample_ids)} samples but "
                              f"{len(order.reward_keys)} reward keys")
        rewards = [await self.get_record(k, RewardRecord) for k in order.reward_keys]
        rollouts = []
        for sample_id, reward in zip(order.sample_ids, rewards, strict=True):
            if reward.sample_id != sample_id:
                raise WorkRefused(f"reward record {reward.sample_id} does not belong to sample {sample_id}")
            rollouts.append(await self.get_record(f"{reward.rollout_key}/trajectory", RolloutRecord))
        advantages = group_advantages(order.group_id, rewards)
        samples = tuple(GroupSample(r.sample_id, r.reward, r.components, adv, rollout.trajectory, r.tests)
                        for r, rollout, adv in zip(rewards, rollouts, advantages, strict=True))
        versions = [v for s in samples for seg in s.trajectory.segments
                    for v, m in zip(seg.versions, seg.loss_mask, strict=True) if m]
        key = f"groups/{order.group_id}/a{order.attempt}"
        await self.put_record(key, GroupRecord(order.group_id, order.prompt_id, min(versions, default=0),
                                               max(versions, default=0), time.time(), samples), ready=True)
        log.info("group_checkpointed", group_id=order.group_id, key=key, prompt_id=order.prompt_id,
                 num_samples=len(samples),
                 mean_reward=sum(s.reward for s in samples) / len(samples),
                 min_version=min(versions, default=0), max_version=max(versions, default=0))
        return GroupDone(order.group_id, order.attempt, key)
