"""RL losses against a hand-written reference, gradcheck, zero-advantage groups, no length normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from actors.stages.grouping import dr_grpo_advantages
from model._engine_core import EngineCore
from model.errors import ConfigError
from model.generation import EngineConfig
from model.loss import (
    PolicyLossConfig,
    packed_logprobs,
    policy_loss,
    sft_forward_backward,
    token_entropy,
    token_logprobs,
)
from model.packing import pack_sequences
from model.sampling import SamplingParams, logprob_temperature, sample_tokens, sampling_logprobs
from tests.model.helpers import random_prompts, seeded_model, small_config


def _reference_loss(logp, behaviour, ref, adv, mask, cap, beta, normalizer) -> float:
    total = 0.0
    for t in range(len(logp)):
        if not mask[t]:
            continue
        ratio = math.exp(float(logp[t]) - float(behaviour[t]))
        total += -min(ratio, cap) * float(adv[t]) + beta * (float(logp[t]) - float(ref[t]))
    return total / normalizer


def _inputs(num_tokens: int = 12, vocab: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    behaviour = token_logprobs(logits, targets) + 0.4 * torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    ref = token_logprobs(logits, targets) + 0.2 * torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    adv = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    mask = torch.rand(num_tokens, generator=gen) > 0.25
    return logits, targets, behaviour, ref, adv, mask


def test_policy_loss_matches_hand_written_reference() -> None:
    logits, targets, behaviour, ref, adv, mask = _inputs()
    cfg = PolicyLossConfig(ratio_cap=1.3, kl_coef=0.05, loss_normalizer=100.0)
    logp = token_logprobs(logits, targets)
    loss, metrics = policy_loss(logp, behaviour, adv, mask, cfg, ref_logprobs_T=ref, entropy_T=token_entropy(logits))
    assert float(loss) == pytest.approx(_reference_loss(logp, behaviour, ref, adv, mask, 1.3, 0.05, 100.0), rel=1e-9)
    ratios = [math.exp(float(a) - float(b)) for a, b, m in zip(logp, behaviour, mask, strict=True) if m]
    assert metrics.num_tokens == int(mask.sum())
    assert metrics.clip_fraction == pytest.approx(sum(r > 1.3 for r in ratios) / len(ratios))
    assert metrics.ratio_max == pytest.approx(max(ratios)) and metrics.ratio_min == pytest.approx(min(ratios))
    assert metrics.kl == pytest.approx(float(((logp - ref) * mask).sum() / mask.sum()))
    probs = torch.softmax(logits, -1)
    ent = -(probs * probs.log()).sum(-1)
    assert metrics.entropy == pytest.approx(float(ent[mask].mean()))


def test_gradcheck_on_tiny_shapes() -> None:
    """Below the cap the loss is a smooth function of the logits; its autograd gradient must be exact.

    (Above the cap the weight is a stop-gradient by design; the next test checks that gradient.)
    """
    logits, targets, behaviour, ref, adv, mask = _inputs(num_tokens=5, vocab=4, seed=1)
    cfg = PolicyLossConfig(ratio_cap=100.0, kl_coef=0.1, loss_normalizer=7.0)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return policy_loss(token_logprobs(x, targets), behaviour, adv, mask, cfg, ref_logprobs_T=ref)[0]

    assert torch.autograd.gradcheck(fn, (logits.clone().requires_grad_(True),))


def test_gradient_is_truncated_ratio_times_advantage_over_constant() -> None:
    logits, targets, behaviour, _, adv, mask = _inputs(seed=2)
    logp = token_logprobs(logits, targets).requires_grad_(True)
    cfg = PolicyLossConfig(ratio_cap=1.2, loss_normalizer=50.0)
    policy_loss(logp, behaviour, adv, mask, cfg)[0].backward()
    weight = torch.exp(logp.detach() - behaviour).clamp(max=1.2)
    assert torch.allclose(logp.grad, -weight * adv * mask / 50.0)


def test_equal_rewards_give_zero_policy_gradient() -> None:
    model = seeded_model(small_config(), seed=3).train()
    seqs = random_prompts(4, 96, 5, 20, seed=3)  # one group of G=4 samples
    batch = pack_sequences(seqs)
    adv_G = torch.tensor(dr_grpo_advantages([0.7] * 4), dtype=torch.float32)
    assert torch.equal(adv_G, torch.zeros(4))
    adv_T = torch.repeat_interleave(adv_G, torch.tensor(batch.seq_lens))
    logp, _ = packed_logprobs(model, batch)
    loss, _ = policy_loss(logp, logp.detach() - 0.1, adv_T, batch.target_mask_T, PolicyLossConfig())
    loss.backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_no_per_sequence_length_normalisation() -> None:
    """Each token's gradient is -w*A/C whatever its sequence's length; losses of sequences add up.

    Dividing by a sequence's length (GRPO), or by the batch's token count, breaks both properties.
    """
    cfg = PolicyLossConfig(loss_normalizer=64.0)
    short_lp = torch.full((3,), -1.0, dtype=torch.float64, requires_grad=True)
    long_lp = torch.full((30,), -1.0, dtype=torch.float64, requires_grad=True)
    logp = torch.cat([short_lp, long_lp])
    adv = torch.ones(33, dtype=torch.float64)
    mask = torch.ones(33, dtype=torch.bool)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, cfg)
    loss.backward()
    assert torch.allclose(short_lp.grad, torch.full((3,), -1 / 64.0, dtype=torch.float64))
    assert torch.allclose(long_lp.grad, torch.full((30,), -1 / 64.0, dtype=torch.float64))
    parts = [policy_loss(x.detach(), x.detach(), adv[: len(x)], mask[: len(x)], cfg)[0] for x in (short_lp, long_lp)]
    assert float(loss.detach()) == pytest.approx(float(sum(parts)))


def test_masked_tokens_contribute_nothing() -> None:
    logits, targets, behaviour, _, adv, mask = _inputs(seed=4)
    logp = token_logprobs(logits, targets).requires_grad_(True)
    policy_loss(logp, behaviour, adv, mask, PolicyLossConfig())[0].backward()
    assert torch.count_nonzero(logp.grad[~mask]) == 0


def test_loss_config_validation() -> None:
    with pytest.raises(ConfigError, match="ratio_cap"):
        PolicyLossConfig(ratio_cap=0.5)
    with pytest.raises(ConfigError, match="loss_normalizer"):
        PolicyLossConfig(loss_normalizer=0)


def test_sft_forward_backward_trains_tiny_model() -> None:
    model = seeded_model(small_config(), seed=5).train()
    batch = pack_sequences([list(range(10, 40)), list(range(50, 70)), [5, 6, 7, 8] * 5])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        losses.append(sft_forward_backward(model, batch, loss_normalizer=float(batch.num_tokens)))
        opt.step()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("current", "behaviour"), [(-1.0, -101.0), (-120.0, -1.0), (-1.0, -1000.0),
                                                    (-1000.0, -1.0), (-800.0, -0.5)])
def test_extreme_log_ratios_give_a_finite_loss_and_the_truncated_gradient(
        dtype: torch.dtype, current: float, behaviour: float) -> None:
    # One token far off-policy among ordinary ones: the textbook sg(w/r)*r is 0*inf or 0/0 there.
    cfg = PolicyLossConfig(ratio_cap=2.0, loss_normalizer=10.0)
    logp = torch.tensor([current, -2.0, -0.5], dtype=dtype, requires_grad=True)
    old = torch.tensor([behaviour, -2.1, -0.5], dtype=dtype)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=dtype)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(3, dtype=torch.bool), cfg)
    loss.backward()
    weight = torch.exp(torch.tensor([current - behaviour, 0.1, 0.0], dtype=torch.float64)).clamp(max=2.0)
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logp.grad).all())
    expected_grad = -weight * adv.double() / 10.0
    assert torch.allclose(logp.grad.double(), expected_grad, rtol=1e-6, atol=1e-30)  # e^-119 is 0 in fp32
    assert float(loss.detach()) == pytest.approx(float(expected_grad.sum()), rel=1e-6)
    assert metrics.clip_fraction == pytest.approx(1 / 3 if current > behaviour else 0.0)
    assert metrics.ratio_min >= 0.0 and not math.isnan(metrics.ratio_max)


def test_a_masked_out_non_finite_token_never_reaches_the_loss() -> None:
    logp = torch.tensor([-1.0, float("-inf"), -0.5], requires_grad=True)
    old = torch.tensor([-1.0, -3.0, float("nan")])
    loss, metrics = policy_loss(logp, old, torch.ones(3), torch.tensor([True, False, False]), PolicyLossConfig())
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logp.grad).all())
    assert metrics.num_tokens == 1 and metrics.ratio_max == 1.0


def test_a_non_finite_trained_log_prob_is_not_hidden() -> None:
    # policy_loss reports it (the learner refuses the step); it never turns it into a finite number.
    logp = torch.tensor([-1.0, float("nan")])
    loss, _ = policy_loss(logp, torch.tensor([-1.0, -1.0]), torch.ones(2), torch.ones(2, dtype=torch.bool),
                          PolicyLossConfig())
    assert math.isnan(float(loss))


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3, 0.05, 4.0])
def test_on_policy_the_ratio_is_exactly_one_in_fp32(temperature: float, top_p: float) -> None:
    """Tokens drawn by the sampler from a model's fp32 logits, scored by the trainer's log-prob function
    on the same logits at the recorded temperature: every importance ratio is exactly 1."""
    model = seeded_model(small_config(), seed=6)
    batch = pack_sequences(random_prompts(6, 96, 5, 25, seed=6))
    with torch.no_grad():
        logits = packed_logprobs(model, batch)[1].logits
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i) for i in range(batch.num_tokens)]
    gens = [torch.Generator().manual_seed(i) for i in range(batch.num_tokens)]
    tokens, recorded = sample_tokens(logits, params, gens)
    temps = torch.full((batch.num_tokens,), logprob_temperature(params[0]))
    logp = token_logprobs(logits, torch.tensor(tokens), temps)
    _, m = policy_loss(logp, torch.tensor(recorded), torch.ones(len(tokens)), torch.ones(len(tokens), dtype=torch.bool),
                       PolicyLossConfig())
    assert (m.ratio_min, m.ratio_max, m.ratio_mean, m.clip_fraction) == (1.0, 1.0, 1.0, 0.0)
    assert torch.equal(logp, torch.tensor(recorded))
    if top_p < 1.0:  # the nucleus did cut: the draws stayed in it, and the recorded log-prob is untruncated
        nucleus = sampling_logprobs(logits, [temperature] * len(tokens), [top_p] * len(tokens))
        drawn = nucleus.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool(torch.isfinite(drawn).all()) and bool((nucleus == float("-inf")).any())
        assert bool((drawn >= logp).all()) and bool((drawn > logp).any())


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.3, 1.0), (1.3, 0.9)])
def test_engine_generations_are_on_policy_for_the_trainer(temperature: float, top_p: float) -> None:
    """The engine's recorded log-probs against the trainer's packed forward at the recorded temperature:
    the ratio is 1 up to the KV-cache/packed forward's fp32 rounding (the old trainer, at temperature 1
    and against nucleus-renormalised log-probs, was off by tens of percent)."""
    model = seeded_model(small_config(), seed=7)
    prompts = random_prompts(4, 96, 3, 12, seed=7)
    engine = EngineCore(model, EngineConfig(max_batch_size=4), version=0, detokenize=None)
    for i, p in enumerate(prompts):
        engine.add(engine.make_request(p, SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p,
                                                         seed=i)))
    gens = [g for _, g in sorted(engine.run_until_done())]
    batch = pack_sequences([list(g.prompt_ids) + list(g.token_ids) for g in gens])
    temps, behaviour, mask = [], [], []
    for g in gens:
        n_prompt, n = len(g.prompt_ids), len(g.prompt_ids) + len(g.token_ids)
        temps += [1.0] * (n_prompt - 1) + [g.logprob_temperature] * len(g.token_ids) + [1.0]
        behaviour += [0.0] * (n_prompt - 1) + list(g.logprobs) + [0.0]
        mask += [False] * (n_prompt - 1) + [True] * len(g.token_ids) + [False]
        assert len(temps) == len(behaviour) == len(mask) and n > n_prompt
    with torch.no_grad():
        logp, _ = packed_logprobs(model, batch, temperatures_T=torch.tensor(temps))
    _, m = policy_loss(logp, torch.tensor(behaviour), torch.ones(len(mask)), torch.tensor(mask), PolicyLossConfig())
    assert all(g.logprob_temperature == temperature for g in gens)
    assert 1 - 1e-4 < m.ratio_min <= m.ratio_max < 1 + 1e-4, m


@pytest.mark.parametrize("field", ["ratio_cap", "kl_coef", "loss_normalizer"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_loss_weight_is_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        PolicyLossConfig(**{field: value})


@pytest.mark.parametrize("bad_temperature", [0.0, math.nan, -1.0, math.inf])
def test_an_unscored_position_cannot_poison_the_gradient(bad_temperature: float) -> None:
    """Whatever temperature an unscored position records, log-probs, loss and every gradient are those of
    T = 1 there: it is replaced before the division (a mask after it is too late: log_softmax's backward
    is 0 - NaN * 0 at that row)."""
    model = seeded_model(small_config(), seed=3).train()
    batch = pack_sequences(random_prompts(3, 96, 8, 16, seed=5))
    gen = torch.Generator().manual_seed(5)
    scored = batch.target_mask_T & (torch.rand(batch.num_tokens, generator=gen) > 0.5)
    temps = torch.full((batch.num_tokens,), 0.8)
    adv = torch.randn(batch.num_tokens, generator=gen)
    grads = []
    for unscored_temperature in (1.0, bad_temperature):
        model.zero_grad(set_to_none=True)
        t = torch.where(scored, temps, torch.full_like(temps, unscored_temperature))
        logp, out = packed_logprobs(model, batch, temperatures_T=t, scored_T=scored)
        assert bool(torch.isfinite(logp).all()) and bool((logp[~scored] == 0).all())
        assert bool(torch.isfinite(token_entropy(out.logits.detach(), t, scored)).all())
        loss, _ = policy_loss(logp, logp.detach() - 0.1, adv, scored, PolicyLossConfig())
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert grads[1] and all(bool(torch.isfinite(g).all()) for g in grads[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
