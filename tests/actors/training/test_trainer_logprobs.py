"""What the learner keeps of each step's forward for the rollout viewer: every trained token's log-prob, exactly as
the loss took it (`Learner.trained_logprobs`, stored by the trainer stage as `TrainerLogprobs`)."""

from __future__ import annotations

import copy
import math

import numpy
import torch

from actors.agent.trajectory import EpisodeEnd, Trajectory
from actors.config import TrainerSection
from actors.records import GroupRecord, GroupSample, TrainerLogprobs, decode_record, encode_record
from actors.training.learner import Learner
from model.sampling import tempered_logprobs
from model.transformer import MoETransformer
from tests.actors.training.test_learner import _group
from tests.model.helpers import seeded_model, small_config


def _values(record: TrainerLogprobs) -> list[numpy.ndarray]:
    return [numpy.frombuffer(seg, dtype="<f4") for seg in record.segments]


def _recomputed(model: MoETransformer, sample: GroupSample) -> list[numpy.ndarray]:
    """Each segment's log-probs by a forward of its own (not packed, the model routing itself) at the
    temperatures the tokens were sampled at: an independent reading of the same weights."""
    out = []
    with torch.no_grad():
        for seg in sample.trajectory.segments:
            ids = torch.tensor(seg.token_ids)
            logits = model(ids, seq_lens=[len(ids)]).logits
            temps = torch.tensor(seg.logprob_temperatures[1:], dtype=torch.float32)
            logp = tempered_logprobs(logits[:-1], temps).gather(1, ids[1:, None])[:, 0]
            out.append(numpy.concatenate([[math.nan], logp.numpy()]).astype("<f4"))
    return out


def test_on_policy_the_stored_log_probs_are_the_behaviour_ones_to_the_bit() -> None:
    # The sampler's forward and the learner's are the same: the ratio is exactly 1, so the trainer's
    # log-prob of each trained token is its behaviour log-prob, bit for bit; the rest are NaN.
    model = seeded_model(small_config(), seed=1)
    group = _group(model, [1.0, 0.0, 0.5, 0.0], seed=2, temperature=0.8)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3, router_replay=True), version=7)
    learner.step([group], "b0")
    records = {r.sample_id: r for r in learner.trained_logprobs}
    assert set(records) == {s.sample_id for s in group.samples}
    for sample in group.samples:
        record = decode_record(encode_record(records[sample.sample_id]), TrainerLogprobs, "k")  # as stored
        assert record.version == 7, "the version whose forward computed them (its step made 8)"
        (seg,), (values,) = sample.trajectory.segments, _values(record)
        assert len(values) == len(seg.token_ids)
        trained = numpy.array(seg.loss_mask, dtype=bool)
        trained[0] = False
        behaviour = numpy.array(seg.behaviour_logprobs, dtype="<f4")
        assert numpy.array_equal(values[trained], behaviour[trained])
        assert numpy.isnan(values[~trained]).all()


def test_off_policy_they_are_what_the_loss_took_and_what_the_weights_give() -> None:
    # After a first step the weights moved: the second step's samples (from the old weights) are off-policy.
    # Its stored log-probs match an independent forward of the weights it started from, and give the very
    # importance ratios its metrics report (the loss's own log-probs, not a copy of the behaviour ones).
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-2, router_replay=False))
    learner.step([_group(model, [1.0, 0.0, 0.5, 0.0], seed=2)], "b0")
    before = copy.deepcopy(learner.model).eval()
    group = _group(model, [0.0, 1.0, 0.25], seed=3, temperature=1.3)
    m = learner.step([group], "b1")
    records = {r.sample_id: r for r in learner.trained_logprobs}
    ratios = []
    for sample in group.samples:
        (seg,), (values,) = sample.trajectory.segments, _values(records[sample.sample_id])
        assert records[sample.sample_id].version == 1
        (independent,) = _recomputed(before, sample)
        trained = ~numpy.isnan(values)
        assert trained.sum() == sum(seg.loss_mask[1:])
        numpy.testing.assert_allclose(values[trained], independent[trained], rtol=0, atol=2e-5)
        behaviour = numpy.array(seg.behaviour_logprobs, dtype="<f4")
        assert not numpy.array_equal(values[trained], behaviour[trained]), "off-policy: not the behaviour ones"
        ratios.extend(numpy.exp(values[trained].astype(numpy.float64) - behaviour[trained]).tolist())
    assert m.ratio_min < 1.0 < m.ratio_max
    assert math.isclose(min(ratios), m.ratio_min, rel_tol=1e-5) and math.isclose(max(ratios), m.ratio_max, rel_tol=1e-5)


def test_a_chain_has_its_log_probs_per_segment() -> None:
    # Two samples' episodes as one chain of two segments: each segment is its own sequence in the forward,
    # on-policy each, and each gets its own array. Equal to a few ulps, not to the bit: how the CPU's matmul
    # blocks a packed batch depends on its shape and the processor (an AMD EPYC gives 4.8e-7 on 4 of 12 tokens).
    model = seeded_model(small_config(), seed=1)
    group = _group(model, [1.0, 0.0, 0.5], seed=4)
    first, second, third = group.samples
    chain = GroupSample("chain", 1.0, first.components, first.advantage,
                        Trajectory([first.trajectory.segments[0], second.trajectory.segments[0]],
                                   EpisodeEnd.FINAL_ANSWER))
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    learner.step([GroupRecord("g", "p", 0, 0, 0.0, (chain, third))], "b0")
    records = {r.sample_id: r for r in learner.trained_logprobs}
    segments = _values(records["chain"])
    assert [len(v) for v in segments] == [len(s.token_ids) for s in chain.trajectory.segments]
    for values, seg in zip(segments, chain.trajectory.segments, strict=True):
        trained = ~numpy.isnan(values)
        behaviour = numpy.array(seg.behaviour_logprobs, dtype="<f4")[trained]
        numpy.testing.assert_allclose(values[trained], behaviour, rtol=0, atol=4e-6)


def test_samples_left_out_of_the_forward_have_none_and_a_step_without_one_keeps_none() -> None:
    model = seeded_model(small_config(), seed=1)
    group = _group(model, [1.0, 0.0, 1.0, 0.0], seed=5)
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    learner.step([group], "b0")
    assert len(learner.trained_logprobs) == 4
    learner.step([_group(model, [1.0, 1.0], seed=6)], "b1")  # advantages all 0, no KL term: no forward
    assert learner.trained_logprobs == [], "the last step's, not an earlier one's"
