"""The learner's RL step: samples without signal are left out of the compute, the update is unchanged;
on-policy the importance ratio is exactly 1 at any temperature and top-p; a step with a non-finite value
is not applied and names its samples."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.config import TrainerSection
from actors.records import GroupRecord, GroupSample, RewardBreakdown, decode_record, encode_record
from actors.stages.grouping import dr_grpo_advantages
from actors.training.learner import Learner
from actors.training.lr_schedule import LRSchedule
from actors.training.step_guard import NonFiniteWeights
from low_precision import ExpertsPrecision, make_experts_fn
from model.checkpoint import load_checkpoint
from model.packing import pack_sequences
from model.sampling import tempered_logprobs
from model.transformer import MoETransformer
from tests.model.helpers import random_prompts, seeded_model, small_config


def _group(model: MoETransformer, rewards: list[float], seed: int, temperature: float = 1.0) -> GroupRecord:
    """A group of trajectories by `model` (random tokens) with the behaviour log-probs a sampler at
    `temperature` records for them (model.sampling.tempered_logprobs), and their experts.

    The log-probs come from one packed forward of the whole group, the forward the learner runs when
    every sample has a signal: on-policy to the bit.
    """
    prompts = random_prompts(len(rewards), model.config.vocab_size, 12, 20, seed=seed)
    batch = pack_sequences(prompts)
    with torch.no_grad():
        out = model(batch.input_ids_T, seq_lens=batch.seq_lens)
    temps_T = torch.full((batch.num_tokens,), temperature)
    logp_T = tempered_logprobs(out.logits, temps_T).gather(1, batch.targets_T[:, None])[:, 0]
    advantages = dr_grpo_advantages(rewards)
    samples, offset = [], 0
    for i, (ids, reward, adv) in enumerate(zip(prompts, rewards, advantages, strict=True)):
        n, prompt = len(ids), 4
        trajectory = Trajectory([Segment(
            token_ids=ids, loss_mask=[0] * prompt + [1] * (n - prompt),
            behaviour_logprobs=[0.0, *logp_T[offset:offset + n - 1].tolist()],
            logprob_temperatures=[1.0] * prompt + [temperature] * (n - prompt),
            versions=[-1] * prompt + [0] * (n - prompt),
            topk_ids_TLK=out.topk_ids_TLK[offset:offset + n].to(torch.int16).numpy(), prompt_len=prompt)],
            end=EpisodeEnd.FINAL_ANSWER)
        components = RewardBreakdown(reward, int(reward == 1.0), 1, 0.0, 0.0, 0, 0.0, reward)
        samples.append(GroupSample(f"s{seed}-{i}", reward, components, adv, trajectory))
        offset += n
    return GroupRecord(f"g{seed}", f"p{seed}", 0, 0, 0.0, tuple(samples))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_on_policy_the_importance_ratio_is_exactly_one_at_any_temperature(temperature: float) -> None:
    # Router replay on and off: the trainer's fp32 forward reproduces the logits the log-probs came from.
    model = seeded_model(small_config(), seed=1)
    for replay in (True, False):
        learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3, router_replay=replay))
        m = learner.step([_group(model, [1.0, 0.0, 0.5, 0.0], seed=2, temperature=temperature)], "b0")
        assert (m.ratio_mean, m.ratio_median, m.ratio_min, m.ratio_max) == (1.0, 1.0, 1.0, 1.0)
        assert m.clip_fraction == 0.0 and m.skipped == "" and m.num_trained_tokens > 0


def test_groups_sampled_at_different_temperatures_train_on_policy_together() -> None:
    # A live rollout.temperature change: one batch holds groups sampled at 0.8 and at 1.3, each token
    # scored at its own temperature. (Each group's log-probs come from its own packed forward, so each
    # group is checked on its own first: a joint packed forward would round differently in the last bit.)
    model = seeded_model(small_config(), seed=1)
    for temperature in (0.05, 0.8, 1.3, 4.0):
        m = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step(
            [_group(model, [1.0, 0.0, 0.25], seed=9, temperature=temperature)], "b")
        assert (m.ratio_min, m.ratio_max) == (1.0, 1.0), temperature
    cold, hot = _group(model, [1.0, 0.0], seed=9, temperature=0.8), _group(model, [0.0, 1.0], seed=10, temperature=1.3)
    m = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step([cold, hot], "b")
    assert abs(m.ratio_min - 1.0) < 1e-5 and abs(m.ratio_max - 1.0) < 1e-5
    for s in hot.samples:  # the same batch scored at one temperature for all is visibly off-policy
        t = s.trajectory.segments[0]
        t.logprob_temperatures = [0.8 if x == 1.3 else x for x in t.logprob_temperatures]
    m = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step([cold, hot], "b")
    assert m.ratio_max - m.ratio_min > 0.1


def test_the_ratio_statistics_report_an_off_policy_batch() -> None:
    # Tokens recorded at T = 0.5 but labelled T = 1 (the old trainer's view of every batch): the ratio
    # moves away from 1 and the metrics show it.
    model = seeded_model(small_config(), seed=1)
    group = _group(model, [1.0, 0.0, 0.5, 0.0], seed=2, temperature=0.5)
    for s in group.samples:
        t = s.trajectory.segments[0]
        t.logprob_temperatures = [1.0] * len(t.token_ids)
    m = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step([group], "b0")
    assert m.ratio_min < 1.0 < m.ratio_max and m.ratio_median != 1.0


def test_advantages_of_equal_rewards_are_exactly_zero() -> None:
    # 0.1 * 3 / 3 is not 0.1 in floating point: the residue must not count as a signal.
    assert dr_grpo_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]


def test_samples_without_signal_are_skipped_and_the_update_is_the_same() -> None:
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2), _group(model, [0.3, 0.3, 0.3, 0.3], seed=3),
              _group(model, [0.0, 0.0, 0.0, 0.0], seed=4)]
    config = TrainerSection(lr=1e-3, kl_coef=0.0)
    skipping = Learner(copy.deepcopy(model), config)
    m = skipping.step(groups, "b0")
    # The same step on the informative group alone, which the full computation reduces to.
    reference = Learner(copy.deepcopy(model), config)
    ref = reference.step(groups[:1], "b0")
    assert (m.num_samples, m.num_computed, ref.num_computed) == (12, 4, 4)
    assert m.num_trained_tokens == ref.num_trained_tokens and m.version == 1
    for (name, p), q in zip(skipping.model.named_parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), skipping.model.parameters(), strict=True))


def test_a_batch_without_signal_advances_the_version_and_leaves_the_weights() -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    m = learner.step([_group(model, [1.0, 1.0, 1.0], seed=5)], "b0")
    assert (m.version, m.num_computed, m.num_trained_tokens, m.pass_rate) == (1, 0, 0, 1.0)
    assert learner.trained_batches == ["b0"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), learner.model.parameters(), strict=True))


def test_with_a_kl_term_every_sample_is_computed() -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3, kl_coef=0.1))
    m = learner.step([_group(model, [1.0, 0.0], seed=6), _group(model, [0.5, 0.5], seed=7)], "b0")
    assert m.num_computed == 4 and m.kl == pytest.approx(0.0, abs=1e-6)


def _cosine(**overrides: Any) -> TrainerSection:
    return TrainerSection(**{"lr": 1e-3, "lr_schedule": "cosine", "lr_min_ratio": 0.1, **overrides})


def test_each_step_uses_the_schedules_lr_and_reports_it() -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), _cosine(), num_steps=5)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2)]
    lrs = [learner.step(groups, f"b{i}").lr for i in range(6)]
    expected = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(v / 4, 1.0)))) for v in range(6)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[0] == pytest.approx(1e-3) and lrs[4] == lrs[5] == pytest.approx(1e-4)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_the_step_applies_the_scheduled_lr_to_the_update() -> None:
    # The same step at the schedule's version-2 lr equals a constant-lr learner's step at that lr.
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2)]
    scheduled = Learner(copy.deepcopy(model), _cosine(), version=2, num_steps=5)
    lr = scheduled.schedule.lr_at(2)
    assert lr == pytest.approx(1e-3 * 0.55)
    constant = Learner(copy.deepcopy(model), TrainerSection(lr=lr, lr_schedule="constant"), version=2)
    assert scheduled.step(groups, "b").lr == constant.step(groups, "b").lr == pytest.approx(lr, rel=1e-12)
    for p, q in zip(scheduled.model.parameters(), constant.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_resumed_learner_continues_the_same_schedule(tmp_path: Path) -> None:
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2)]
    straight = Learner(copy.deepcopy(model), _cosine(), num_steps=6)
    stopped = Learner(copy.deepcopy(model), _cosine(), num_steps=6)
    for i in range(3):
        straight.step(groups, f"b{i}")
        stopped.step(groups, f"b{i}")
    resumed = Learner.load(stopped.save(tmp_path), _cosine(), num_steps=6)
    assert resumed.version == 3 and resumed.lr == pytest.approx(straight.lr, rel=1e-12)
    for i in range(3, 6):
        assert resumed.step(groups, f"b{i}").lr == pytest.approx(straight.step(groups, f"b{i}").lr, rel=1e-12)
    assert resumed.lr == pytest.approx(1e-4)


def test_a_live_lr_change_rescales_the_schedules_peak() -> None:
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2)]
    learner = Learner(copy.deepcopy(model), _cosine(), num_steps=5)
    learner.step(groups, "b0")
    learner.set_lr(5e-4)  # halfway down the cosine of peak 1e-3 an operator halves the peak
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(learner.schedule.lr_at(1))
    lrs = [learner.step(groups, f"b{i}").lr for i in range(1, 5)]
    reference = LRSchedule("cosine", peak=5e-4, min_ratio=0.1, num_steps=5)
    assert lrs == pytest.approx([reference.lr_at(v) for v in range(1, 5)], rel=1e-12)
    assert lrs[-1] == pytest.approx(5e-5)


def test_a_constant_schedule_with_a_live_change_uses_the_new_lr() -> None:
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 1.0, 0.0], seed=2)]
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=2e-4, lr_schedule="constant"), num_steps=70)
    assert learner.step(groups, "b0").lr == 2e-4
    learner.set_lr(3e-4)
    assert learner.step(groups, "b1").lr == 3e-4


def _unchanged(a: MoETransformer, b: MoETransformer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _poison_behaviour(group: GroupRecord, index: int, value: float) -> str:
    t = group.samples[index].trajectory.segments[0]
    t.behaviour_logprobs[t.loss_mask.index(1) + 2] = value
    return group.samples[index].sample_id


@pytest.mark.parametrize(("field", "value"), [
    ("logprob_temperatures", 0.0), ("logprob_temperatures", -1.0), ("logprob_temperatures", float("nan")),
    ("logprob_temperatures", float("inf")), ("behaviour_logprobs", 0.5),  # a log-prob above 0
])
def test_an_unusable_temperature_or_log_prob_is_refused(field: str, value: float) -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    t = groups[0].samples[1].trajectory.segments[0]
    getattr(t, field)[-1] = value
    m = learner.step(groups, "b0")
    assert (m.skipped, m.non_finite_sample_ids) == ("input", ("s2-1",)) and _unchanged(model, learner.model)


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), float("inf")])
def test_a_step_with_one_non_finite_behaviour_logprob_is_not_applied_and_names_the_sample(
        value: float, tmp_path: Path) -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2), _group(model, [1.0, 0.0], seed=3)]
    bad = _poison_behaviour(groups[1], 1, value)
    m = learner.step(groups, "b0")
    assert (m.skipped, m.non_finite_sample_ids, m.version) == ("input", (bad,), 1)
    assert _unchanged(model, learner.model) and learner.trained_batches == ["b0"]
    assert not learner.optimizer.state  # no Adam moment was touched either
    # the checkpoint the trainer saves next holds the last good weights
    _, saved = load_checkpoint(learner.save(tmp_path))
    assert _unchanged(model, saved)
    # and the next good batch trains normally
    assert learner.step([_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)], "b1").skipped == ""
    assert not _unchanged(model, learner.model)


def _with_rewards(group: GroupRecord, rewards: list[float], advantages: list[float]) -> GroupRecord:
    """``group`` as a grouping that did not check its rewards wrote it (the record is all the trainer sees)."""
    samples = tuple(dataclasses.replace(s, reward=r, advantage=a)
                    for s, r, a in zip(group.samples, rewards, advantages, strict=True))
    return dataclasses.replace(group, samples=samples)


@pytest.mark.parametrize(("rewards", "advantages", "named"), [
    # all equal: advantage 0, a group without signal, left out of the forward: its rewards are checked all the same
    ([-math.inf, -math.inf], [0.0, 0.0], {"s3-0", "s3-1"}),
    ([math.inf, math.inf, math.inf], [0.0, 0.0, 0.0], {"s3-0", "s3-1", "s3-2"}),
    ([1.0, math.nan, 0.0], [math.nan] * 3, {"s3-0", "s3-1", "s3-2"}),  # NaN spreads to every advantage
    ([1.0, -math.inf], [1.0, 0.0], {"s3-1"}),  # a record whose advantages look fine
], ids=["minus-inf-pair", "plus-inf-triple", "nan", "one-inf"])
def test_a_non_finite_reward_is_refused_naming_its_samples(rewards: list[float], advantages: list[float],
                                                           named: set[str]) -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    good = _group(model, [1.0, 0.0], seed=2)
    poisoned = _with_rewards(_group(model, [0.0] * len(rewards), seed=3), rewards, advantages)
    m = learner.step([good, poisoned], "b0")
    assert m.skipped == "input" and set(m.non_finite_sample_ids) == named and m.version == 1
    assert _unchanged(model, learner.model) and not learner.optimizer.state


def _untrained_index(group: GroupRecord, sample: int) -> int:
    """A prompt token after the first of its segment (whose values no position reads) of ``sample``."""
    mask = group.samples[sample].trajectory.segments[0].loss_mask
    return mask.index(1) - 1


@pytest.mark.parametrize(("field", "value"), [
    ("logprob_temperatures", 0.0), ("logprob_temperatures", math.nan), ("logprob_temperatures", -0.5),
    ("logprob_temperatures", math.inf), ("logprob_temperatures", 1e-50),  # 0 in the float32 the step divides by
    ("behaviour_logprobs", math.inf), ("behaviour_logprobs", math.nan), ("behaviour_logprobs", 3.0),
])
def test_an_unusable_value_on_an_untrained_token_is_refused_naming_the_sample(field: str, value: float) -> None:
    # A tool output's (or prompt's) temperature of 0 would make log_softmax(z / 0) NaN at a position the loss never
    # uses, and NaN * 0 would take the whole gradient: a value no producer writes there is a bad record.
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    t = groups[0].samples[1].trajectory.segments[0]
    j = _untrained_index(groups[0], 1)
    getattr(t, field)[j] = value
    m = learner.step(groups, "b0")
    assert (m.skipped, m.non_finite_sample_ids) == ("input", ("s2-1",)) and _unchanged(model, learner.model)


@pytest.mark.parametrize(("field", "value"), [
    ("logprob_temperatures", 1e-50), ("logprob_temperatures", 1e39),  # float32: 0 and inf
    ("behaviour_logprobs", -1e39),  # float32: -inf
    ("advantage", 1e39),
])
def test_a_value_out_of_float32_range_is_refused_at_input(field: str, value: float) -> None:
    # finite and in range as a Python float, not as the float32 the step computes with
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    group = _group(model, [1.0, 0.0, 0.5, 0.0], seed=2)
    if field == "advantage":
        group = _with_rewards(group, [s.reward for s in group.samples],
                              [s.advantage if i != 1 else value for i, s in enumerate(group.samples)])
    else:
        getattr(group.samples[1].trajectory.segments[0], field)[-1] = value
    m = learner.step([group], "b0")
    assert (m.skipped, m.non_finite_sample_ids) == ("input", ("s2-1",)) and _unchanged(model, learner.model)


def test_an_untrained_position_cannot_poison_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the input check (here: switched off), a temperature of 0 or NaN on untrained tokens changes
    # nothing: the step is the one with T = 1 there, to the bit.
    model = seeded_model(small_config(), seed=1)
    clean = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    clean_metrics = clean.step([_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)], "b0")
    monkeypatch.setattr("actors.training.learner.non_finite_inputs", lambda samples: None)
    poisoned = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    group = _group(model, [1.0, 0.0, 0.5, 0.0], seed=2)
    for s, value in zip(group.samples, (0.0, math.nan, -1.0, 0.0), strict=True):
        t = s.trajectory.segments[0]
        t.logprob_temperatures = [value if not keep else x for x, keep in zip(t.logprob_temperatures, t.loss_mask,
                                                                               strict=True)]
    m = poisoned.step([group], "b0")
    assert m.skipped == "" and math.isfinite(m.grad_norm) and m.grad_norm == clean_metrics.grad_norm
    assert m.entropy == clean_metrics.entropy
    assert _unchanged(clean.model, poisoned.model)


def test_samples_of_one_token_and_samples_without_trained_tokens_train() -> None:
    # a sample of a single token (nothing to predict) and one whose loss mask is all 0 (nothing sampled),
    # both with an advantage: they join the forward and add nothing; the step is that of the others
    model = seeded_model(small_config(), seed=1)
    group = _group(model, [1.0, 0.0, 0.5, 0.0], seed=2)
    one = group.samples[0].trajectory.segments[0]
    for name in ("token_ids", "loss_mask", "behaviour_logprobs", "logprob_temperatures", "versions"):
        setattr(one, name, getattr(one, name)[:1])
    one.topk_ids_TLK = one.topk_ids_TLK[:1]
    none = group.samples[1].trajectory.segments[0]
    none.loss_mask = [0] * len(none.loss_mask)
    m = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step([group], "b0")
    assert m.skipped == "" and m.num_computed == 4 and math.isfinite(m.loss) and math.isfinite(m.grad_norm)
    trained = sum(sum(s.trajectory.segments[0].loss_mask[1:]) for s in group.samples)
    assert m.num_trained_tokens == trained
    # a batch whose computed samples train no token at all: a finite step of a zero gradient
    for s in group.samples:
        t = s.trajectory.segments[0]
        t.loss_mask = [0] * len(t.loss_mask)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    m = learner.step([group], "b1")
    assert (m.skipped, m.num_trained_tokens, m.loss, m.grad_norm) == ("", 0, 0.0, 0.0)


def test_a_segment_without_tokens_is_refused_by_name() -> None:
    # it failed in the packing of the one rank whose share held it, leaving the others in a collective
    model = seeded_model(small_config(), seed=1)
    group = _group(model, [1.0, 0.0], seed=2)
    t = group.samples[1].trajectory.segments[0]
    for name in ("token_ids", "loss_mask", "behaviour_logprobs", "logprob_temperatures", "versions"):
        setattr(t, name, [])
    with pytest.raises(ValueError, match=r"s2-1 segment 0: a segment without tokens"):
        Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step([group], "b0")


def test_a_non_finite_loss_from_the_forward_names_the_sample() -> None:
    # A temperature that is positive but divides the logits into inf: the forward's log-probs are NaN.
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    t = groups[0].samples[2].trajectory.segments[0]
    t.logprob_temperatures[-1] = 1e-40
    m = learner.step(groups, "b0")
    assert (m.skipped, m.non_finite_sample_ids) == ("loss", ("s2-2",))
    assert _unchanged(model, learner.model)


def test_a_loss_with_extreme_log_ratios_stays_finite_and_is_applied() -> None:
    # Behaviour log-probs of -101 and -120 against the current ~-4: ratios of e^97 and e^116 are capped.
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    _poison_behaviour(groups[0], 0, -101.0)
    _poison_behaviour(groups[0], 1, -120.0)
    m = learner.step(groups, "b0")
    assert m.skipped == "" and math.isfinite(m.loss) and math.isfinite(m.grad_norm)
    assert m.ratio_max == math.inf and m.clip_fraction > 0
    assert all(bool(torch.isfinite(p).all()) for p in learner.model.parameters())


def test_a_non_finite_gradient_is_not_applied_and_the_samples_are_named() -> None:
    # A gradient that overflows for one sample only (the embedding row of a token only it contains).
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    ids = groups[0].samples[3].trajectory.segments[0].token_ids
    others = {t for s in groups[0].samples[:3] for t in s.trajectory.segments[0].token_ids}
    only_here = next(t for t in ids if t not in others)
    embedding = next(p for name, p in learner.model.named_parameters() if "embed" in name)

    def overflow(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # the row is nonzero only when the sample holding the token is in the batch
        grad[only_here] = torch.where(grad[only_here] != 0, float("inf"), 0.0)
        return grad

    embedding.register_hook(overflow)
    m = learner.step(groups, "b0")
    assert (m.skipped, m.non_finite_sample_ids) == ("gradient", ("s2-3",))
    assert not math.isfinite(m.grad_norm) and _unchanged(model, learner.model) and not learner.optimizer.state


def test_a_non_finite_update_is_rolled_back() -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    learner.step(groups, "b0")
    after_first = copy.deepcopy(learner.model)
    moments = {k: v.clone() for k, v in learner.optimizer.state[next(learner.model.parameters())].items()}

    def overflow(optimizer: torch.optim.Optimizer, *_: Any) -> None:  # an update that overflows one weight
        with torch.no_grad():
            next(learner.model.parameters())[0, 0] = float("inf")

    handle = learner.optimizer.register_step_post_hook(overflow)
    m = learner.step(groups, "b1")
    handle.remove()
    assert m.skipped == "update" and set(m.non_finite_sample_ids) == {f"s2-{i}" for i in range(4)}
    assert _unchanged(after_first, learner.model)
    restored = learner.optimizer.state[next(learner.model.parameters())]
    assert all(torch.equal(restored[k], v) for k, v in moments.items())
    assert learner.step(groups, "b2").skipped == ""


def test_non_finite_weights_are_never_saved(tmp_path: Path) -> None:
    learner = Learner(seeded_model(small_config(), seed=1), TrainerSection(lr=1e-3))
    with torch.no_grad():
        next(learner.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeights, match="refusing to save"):
        learner.save(tmp_path)
    assert not list(tmp_path.iterdir())


def test_an_infinite_expert_weight_is_not_hidden_by_the_quantized_experts() -> None:
    # NVFP4 forward / MXFP8 backward, as the trainer runs with policy.experts_precision = "emulated".
    # Before the NVFP4 rule an inf weight became a finite 2688 and the step was applied.
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)]
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    learner.model.set_experts_fn(make_experts_fn(ExpertsPrecision.EMULATED))
    with torch.no_grad():
        learner.model.model.layers[0].mlp.w_up_EFD[1, 3, 7] = float("inf")
    poisoned = copy.deepcopy(learner.model)
    m = learner.step(groups, "b0")
    assert m.skipped == "loss" and len(m.non_finite_sample_ids) >= 1
    assert all(torch.equal(p, q) for p, q in zip(poisoned.parameters(), learner.model.parameters(), strict=True))


def test_a_trajectory_without_per_token_temperatures_is_refused_by_name() -> None:
    model = seeded_model(small_config(), seed=1)
    # a stored group whose trajectory lacks the field (a rollout older than per-token temperatures): its
    # record is refused when the trainer reads it, naming the sample and the field
    stored = msgspec.msgpack.decode(encode_record(_group(model, [1.0, 0.0], seed=2)))
    del stored["samples"][1]["trajectory"]["segments"][0]["logprob_temperatures"]
    with pytest.raises(ValueError, match=r"s2-1.*logprob_temperatures"):
        decode_record(msgspec.msgpack.encode(stored), GroupRecord, "groups/g2/a0")
    groups = [_group(model, [1.0, 0.0], seed=2)]
    groups[0].samples[0].trajectory.segments[0].logprob_temperatures.pop()
    with pytest.raises(ValueError, match=r"s2-0 segment 0: \d+ tokens"):
        Learner(copy.deepcopy(model), TrainerSection(lr=1e-3)).step(groups, "b0")
