"""The learner's RL step: samples without signal are left out of the compute, the update is unchanged."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.agent import _tensor_to_wire
from actors.config import TrainerSection
from actors.learner import Learner
from actors.lr_schedule import LRSchedule
from model.loss import advantages_dr_grpo
from model.transformer import MoETransformer
from tests.model.helpers import random_prompts, seeded_model, small_config


def _group(model: MoETransformer, rewards: list[float], seed: int) -> dict[str, Any]:
    """A group of trajectories sampled (here: random tokens) by `model`, with its own log-probs and experts."""
    samples = []
    for ids, reward in zip(random_prompts(len(rewards), model.config.vocab_size, 12, 20, seed=seed), rewards,
                           strict=True):
        with torch.no_grad():
            out = model(torch.tensor(ids), seq_lens=[len(ids)])
        logp = torch.log_softmax(out.logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        prompt = 4
        samples.append({"reward": reward, "components": {"pass_fraction": reward},
                        "trajectory": {"token_ids": ids, "loss_mask": [0] * prompt + [1] * (len(ids) - prompt),
                                       "behaviour_logprobs": [0.0, *logp.tolist()],
                                       "versions": [-1] * prompt + [0] * (len(ids) - prompt),
                                       "topk_ids_TLK": _tensor_to_wire(out.topk_ids_TLK.to(torch.int16))}})
    for s, adv in zip(samples, advantages_dr_grpo(torch.tensor(rewards, dtype=torch.float64)).tolist(), strict=True):
        s["advantage"] = adv
    return {"samples": samples}


def test_advantages_of_equal_rewards_are_exactly_zero() -> None:
    # 0.1 * 3 / 3 is not 0.1 in floating point: the residue must not count as a signal.
    assert advantages_dr_grpo(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)).tolist() == [0.0, 0.0, 0.0]


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
