"""Gradient accumulation (`trainer.micro_batch_tokens`): the computed samples go through forward and backward in
token-bounded micro-batches, never splitting a sample or a chain, and one optimizer step follows. The loss is a
token sum over a constant, so the step is the whole batch's to float tolerance: the updated weights, every metric
and the log-probs recorded per sample."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy
import pytest
import torch

from actors.config import TrainerSection
from actors.records import GroupRecord
from actors.training.learner import Learner, StepMetrics, _micro_batches
from actors.training.ranks import RankLayout
from model.packing import SequenceCost, assign_to_ranks
from model.transformer import MoETransformer
from tests.actors.training import rank_worker
from tests.actors.training.test_chain_training import _sample, _segments
from tests.actors.training.test_learner import _group
from tests.actors.training.test_ranks_equivalence import assert_same_step
from tests.model.helpers import seeded_model, small_config


def test_micro_batches_are_consecutive_token_bounded_and_a_long_sample_stands_alone() -> None:
    assert _micro_batches([10, 20, 5, 40, 3, 3], 30) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert _micro_batches([10, 20, 5], 0) == [range(0, 3)]
    assert _micro_batches([], 30) == []


def _batch(model: MoETransformer) -> list[GroupRecord]:
    """Two groups of single-segment samples (off-policy after a first step) and a group of chains."""
    segs = _segments(model, 7, seed=11)
    chains = GroupRecord("gc", "pc", 0, 0, 0.0, (_sample("c0", 0.5, segs[:3]), _sample("c1", -0.25, segs[3:5]),
                                                 _sample("c2", -0.25, segs[5:])))
    return [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2, temperature=0.8),
            _group(model, [0.0, 1.0, 1.0, 0.25], seed=3), chains]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def _metrics_equal(a: StepMetrics, b: StepMetrics) -> None:
    assert (a.num_tokens, a.num_trained_tokens, a.num_computed, a.skipped) == (
        b.num_tokens, b.num_trained_tokens, b.num_computed, b.skipped)
    for field in ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "ratio_median", "ratio_min",
                  "ratio_max", "grad_norm", "replay_replaced_fraction"):
        assert _close(getattr(a, field), getattr(b, field)), (field, getattr(a, field), getattr(b, field))


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_a_step_in_micro_batches_is_the_whole_batchs_step(kl_coef: float) -> None:
    model = seeded_model(small_config(), seed=1)
    groups = _batch(model)
    longest = max(s.trajectory.num_tokens for g in groups for s in g.samples)
    # smaller than the longest chain (it goes alone, whole), several samples in the others
    budget = longest - 1
    whole = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3, kl_coef=kl_coef, ratio_cap=1.05))
    micro = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3, kl_coef=kl_coef, ratio_cap=1.05,
                                                         micro_batch_tokens=budget))
    computed = [s for g in groups for s in g.samples if kl_coef > 0 or s.advantage != 0.0]
    assert len(_micro_batches([s.trajectory.num_tokens for s in computed], budget)) >= 3
    for step in range(2):  # the second step is off-policy: ratios away from 1, some clipped
        mw, mm = whole.step(groups, f"b{step}"), micro.step(groups, f"b{step}")
        _metrics_equal(mw, mm)
        assert mw.skipped == "" and mw.num_trained_tokens > 0
        # Adam divides by the gradient's scale: where a gradient is near 0 its rounding moves the update, so
        # the weights agree to 1% of one step (lr 1e-3), the gradients' sums to float rounding
        for p, q in zip(whole.model.parameters(), micro.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0.0, atol=1e-5)
        assert not all(torch.equal(p, p0) for p, p0 in zip(whole.model.parameters(), model.parameters(), strict=True))
        records = {r.sample_id: r for r in micro.trained_logprobs}
        assert [r.sample_id for r in whole.trained_logprobs] == [r.sample_id for r in micro.trained_logprobs]
        for r in whole.trained_logprobs:
            for a, b in zip(r.segments, records[r.sample_id].segments, strict=True):
                numpy.testing.assert_allclose(numpy.frombuffer(a, "<f4"), numpy.frombuffer(b, "<f4"),
                                              rtol=1e-5, atol=1e-6)
    assert mw.ratio_max > 1.0 and mw.clip_fraction > 0.0, "the second step was off-policy"


def test_a_non_finite_loss_in_a_later_micro_batch_names_its_sample_and_applies_nothing() -> None:
    model = seeded_model(small_config(), seed=1)
    segs = _segments(model, 4, seed=5)
    group = GroupRecord("g", "p", 0, 0, 0.0, (_sample("a", 0.5, segs[:2]), _sample("b", -0.5, segs[2:])))
    # a token only the second chain holds embeds as NaN (the output head untied, so that no logit is): its
    # inputs pass every check, its loss does not
    only_b = set(segs[3].token_ids) - {t for seg in segs[:2] for t in seg.token_ids}
    broken = copy.deepcopy(model)
    broken.lm_head.weight = torch.nn.Parameter(broken.lm_head.weight.detach().clone())
    with torch.no_grad():
        broken.model.embed_tokens.weight[min(only_b)] = float("nan")
    before = copy.deepcopy(broken)
    budget = max(s.trajectory.num_tokens for s in group.samples)  # one sample per micro-batch
    learner = Learner(broken, TrainerSection(lr=1e-3, micro_batch_tokens=budget))
    m = learner.step([group], "b")
    assert m.skipped == "loss" and m.non_finite_sample_ids == ("b",)
    assert all(torch.equal(p, q) or bool(torch.isnan(p).any())
               for p, q in zip(learner.model.parameters(), before.parameters(), strict=True))
    assert all(p.grad is None for p in learner.model.parameters()), "the first micro-batch's gradient is dropped"


@pytest.mark.parametrize(("world_size", "expert_parallel"), [(2, 1), (2, 2)], ids=["2dp", "2ep"])
def test_ranks_with_different_numbers_of_micro_batches_take_the_step_one_rank_takes(
        tmp_path: Path, world_size: int, expert_parallel: int) -> None:
    # ~16-token samples, a 29-token budget: the two shares split into 6 and 5 micro-batches; the ranks agree on
    # 6 and the other runs a masked forward (expert parallelism's all-to-alls pair up in each forward and backward)
    model = rank_worker.starting_model()
    computed = [s for g in rank_worker.batch(model) for s in g.samples if s.advantage != 0.0]
    lengths = [s.trajectory.num_tokens for s in computed]
    shares = assign_to_ranks(lengths, world_size, SequenceCost.for_model(model.config))
    assert len({len(_micro_batches([lengths[i] for i in sorted(r)], 29)) for r in shares}) > 1
    one_state, one_metrics = rank_worker.step_once(RankLayout(), replay=True)
    out, rendezvous = tmp_path / "many.pt", tmp_path / "rdzv"
    rank_worker.launch(rank_worker.main, (world_size, expert_parallel, True, 0.0, str(rendezvous), str(out), 29),
                       world_size)
    many = torch.load(out)
    assert_same_step(one_state, one_metrics, many["state"], many["metrics"])
