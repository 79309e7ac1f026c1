"""Training on self-summarization chains: one advantage per chain reaches every token the policy wrote in
every segment (its summaries included) and nothing else; segments pack as separate sequences of one sample;
a chain of one segment trains exactly as a trajectory did before chains."""

from __future__ import annotations

import copy

import torch

from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.config import RewardSection, TrainerSection
from actors.records import GroupRecord, GroupSample, RewardBreakdown
from actors.stages.reward import compute_reward
from actors.training.learner import Learner, _aligned
from actors.training.reference_chains import reference_chain
from model.packing import pack_sequences
from model.sampling import tempered_logprobs
from model.transformer import MoETransformer
from sandbox.long_context_tasks import generate_long_context_tasks
from tests.model.helpers import random_prompts, seeded_model, small_config

_BREAKDOWN = RewardBreakdown(1.0, 1, 1, 0.0, 0.0, 0, 0.0, 1.0)


def _sample(sample_id: str, advantage: float, segments: list[Segment]) -> GroupSample:
    return GroupSample(sample_id, 1.0, _BREAKDOWN, advantage, Trajectory(segments, EpisodeEnd.FINAL_ANSWER))


def test_a_chains_advantage_reaches_every_policy_token_of_every_segment_and_nothing_else() -> None:
    chain = reference_chain(generate_long_context_tasks(0, 1)[0])
    assert len(chain.segments) == 3 and all(s.summary_len for s in chain.segments[:2])
    other = reference_chain(generate_long_context_tasks(0, 2)[1])
    samples = [GroupSample("c0", 0.0, _BREAKDOWN, 0.75, chain), GroupSample("c1", 0.0, _BREAKDOWN, -0.75, other)]
    batch = pack_sequences([seg.token_ids for s in samples for seg in s.trajectory.segments])
    assert list(batch.seq_lens) == [len(seg.token_ids) for s in samples for seg in s.trajectory.segments]
    _, _, mask, advantages, replay = _aligned(samples, batch.num_tokens)
    weight = torch.where(mask, advantages, 0.0)  # what multiplies each position's policy-gradient term
    expected = torch.zeros(batch.num_tokens)
    summary_positions = []
    offset = 0
    for s in samples:
        for seg in s.trajectory.segments:
            for j, trained in enumerate(seg.loss_mask):
                if j > 0 and trained:  # position j-1 predicts token j
                    expected[offset + j - 1] = s.advantage
            summary_positions += range(offset + len(seg.token_ids) - seg.summary_len - 1,
                                       offset + len(seg.token_ids) - 1)
            offset += len(seg.token_ids)
    assert torch.equal(weight, expected)
    assert summary_positions and bool((weight[summary_positions] != 0).all()), "summaries carry the advantage"
    # every position whose next token is template or tool output (or a segment's last) carries nothing
    assert int((weight != 0).sum()) == sum(sum(seg.loss_mask[1:]) for s in samples for seg in s.trajectory.segments)
    assert replay.shape[0] == batch.num_tokens


def _segments(model: MoETransformer, n: int, seed: int) -> list[Segment]:
    """Segments of random tokens with on-policy behaviour log-probs and the model's experts."""
    prompts = random_prompts(n, model.config.vocab_size, 12, 20, seed=seed)
    batch = pack_sequences(prompts)
    with torch.no_grad():
        out = model(batch.input_ids_T, seq_lens=batch.seq_lens)
    logp = tempered_logprobs(out.logits, torch.ones(batch.num_tokens)).gather(1, batch.targets_T[:, None])[:, 0]
    segments, offset = [], 0
    for ids in prompts:
        k = len(ids)
        segments.append(Segment(ids, [0] * 4 + [1] * (k - 4), [0.0, *logp[offset:offset + k - 1].tolist()],
                                [1.0] * k, [-1] * 4 + [0] * (k - 4),
                                out.topk_ids_TLK[offset:offset + k].to(torch.int16).numpy(), 4))
        offset += k
    return segments


def _same(a: MoETransformer, b: MoETransformer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_chain_trains_as_its_segments_would_as_samples_of_the_same_advantage() -> None:
    # The loss normaliser's meaning: a chain's segments add their trained tokens to the batch's token sum,
    # exactly as the same sequences would as separate samples; nothing is averaged per chain.
    model = seeded_model(small_config(), seed=1)
    segs = _segments(model, 5, seed=3)
    chained = GroupRecord("g", "p", 0, 0, 0.0, (_sample("a", 0.5, segs[:3]), _sample("b", -0.5, segs[3:])))
    flat = GroupRecord("g", "p", 0, 0, 0.0, tuple(_sample(f"s{i}", 0.5 if i < 3 else -0.5, [s])
                                                  for i, s in enumerate(segs)))
    config = TrainerSection(lr=1e-3)
    one, two = Learner(copy.deepcopy(model), config), Learner(copy.deepcopy(model), config)
    m1, m2 = one.step([chained], "b"), two.step([flat], "b")
    assert (m1.num_tokens, m1.num_trained_tokens, m1.loss) == (m2.num_tokens, m2.num_trained_tokens, m2.loss)
    assert m1.ratio_min == m1.ratio_max == 1.0 and m1.skipped == ""
    assert _same(one.model, two.model) and not _same(one.model, model)


def test_a_non_finite_log_prob_in_a_later_segment_names_the_chain() -> None:
    model = seeded_model(small_config(), seed=1)
    segs = _segments(model, 4, seed=5)
    segs[3].behaviour_logprobs[-1] = float("nan")
    group = GroupRecord("g", "p", 0, 0, 0.0, (_sample("a", 0.5, segs[:2]), _sample("b", -0.5, segs[2:])))
    learner = Learner(copy.deepcopy(model), TrainerSection(lr=1e-3))
    m = learner.step([group], "b")
    assert (m.skipped, m.non_finite_sample_ids) == ("input", ("b",)) and _same(learner.model, model)


def _flat_aligned(samples: list[GroupSample], num_tokens: int) -> tuple[torch.Tensor, ...]:
    """The flat alignment (one flat token list per trajectory, no chains), for comparison."""
    behaviour, temperatures = torch.zeros(num_tokens), torch.ones(num_tokens)
    mask, advantages = torch.zeros(num_tokens, dtype=torch.bool), torch.zeros(num_tokens)
    rows, offset = [], 0
    for s in samples:
        (t,) = s.trajectory.segments
        n = len(t.token_ids)
        behaviour[offset:offset + n - 1] = torch.tensor(t.behaviour_logprobs[1:])
        temperatures[offset:offset + n - 1] = torch.tensor(t.logprob_temperatures[1:], dtype=torch.float32)
        mask[offset:offset + n - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        advantages[offset:offset + n] = s.advantage
        rows.append(torch.from_numpy(t.topk_ids_TLK[:n]).long())
        offset += n
    return behaviour, temperatures, mask, advantages, torch.cat(rows, dim=0)


def test_a_chain_of_one_segment_is_aligned_exactly_as_a_trajectory_was() -> None:
    # What the learner feeds the loss for one-segment chains is, tensor for tensor, what it fed for the flat
    # trajectories of before (checked against the pre-chain checkout too: the same weights after a step).
    model = seeded_model(small_config(), seed=1)
    samples = [_sample(f"s{i}", a, [seg]) for i, (a, seg) in enumerate(zip([0.5, -0.25, 0.0, -0.25],
                                                                         _segments(model, 4, seed=2), strict=True))]
    n = sum(len(s.trajectory.segments[0].token_ids) for s in samples)
    for new, old in zip(_aligned(samples, n), _flat_aligned(samples, n), strict=True):
        assert new.dtype == old.dtype and torch.equal(new, old)


def test_the_length_penalty_counts_the_whole_chain_summaries_included() -> None:
    chain = reference_chain(generate_long_context_tasks(0, 1)[0])
    cfg = RewardSection(length_coef=0.1)
    with_summaries = compute_reward(chain, 5, 5, cfg)
    chain.num_summary_tokens = 0
    without = compute_reward(chain, 5, 5, cfg)
    assert with_summaries.weighted_length > without.weighted_length > 0
    assert with_summaries.length_penalty > without.length_penalty and with_summaries.pass_fraction == 1.0
