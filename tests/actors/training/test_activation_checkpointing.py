"""Activation checkpointing (`trainer.activation_checkpointing`, model.activation_checkpoint): each layer's
activations are recomputed in the backward. The step is the one taken without it, to float tolerance (the updated
weights, every metric, the log-probs recorded per sample), with and without router replay, in micro-batches, on
expert-parallel ranks and with the low-precision experts; the recompute routes every token to the experts the
forward chose, and decides and counts nothing again."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy
import pytest
import torch

from actors.config import TrainerSection
from actors.training.learner import Learner
from actors.training.ranks import RankLayout
from low_precision import ExpertsPrecision, make_experts_fn
from model import moe
from model.packing import pack_sequences
from model.transformer import MoETransformer
from tests.actors.training import rank_worker
from tests.actors.training.test_micro_batches import _batch, _metrics_equal
from tests.actors.training.test_ranks_equivalence import assert_same_step
from tests.model.helpers import random_prompts, seeded_model, small_config


def _steps(model: MoETransformer, config: TrainerSection) -> tuple[Learner, Learner]:
    """Two steps (the second off-policy) of a learner without and one with checkpointing, checked equal."""
    groups = _batch(model)
    plain = Learner(copy.deepcopy(model), config)
    ckpt = Learner(copy.deepcopy(model), dataclasses.replace(config, activation_checkpointing=True))
    assert ckpt.model.activation_checkpointing and not plain.model.activation_checkpointing
    for step in range(2):
        mp, mc = plain.step(groups, f"b{step}"), ckpt.step(groups, f"b{step}")
        _metrics_equal(mp, mc)
        assert mp.skipped == "" and mp.num_trained_tokens > 0
        for p, q in zip(plain.model.parameters(), ckpt.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0.0, atol=1e-6)
        records = {r.sample_id: r for r in ckpt.trained_logprobs}
        assert [r.sample_id for r in plain.trained_logprobs] == list(records)
        for r in plain.trained_logprobs:
            for a, b in zip(r.segments, records[r.sample_id].segments, strict=True):
                numpy.testing.assert_allclose(numpy.frombuffer(a, "<f4"), numpy.frombuffer(b, "<f4"),
                                              rtol=1e-6, atol=1e-6)
    assert mp.ratio_max > 1.0, "the second step was off-policy"
    return plain, ckpt


@pytest.mark.parametrize("micro_batch_tokens", [0, 29], ids=["whole", "micro"])
@pytest.mark.parametrize("router_replay", [True, False], ids=["replay", "live"])
def test_a_checkpointed_step_is_the_step_without(router_replay: bool, micro_batch_tokens: int) -> None:
    model = seeded_model(small_config(), seed=1)
    _steps(model, TrainerSection(lr=1e-3, ratio_cap=1.05, router_replay=router_replay,
                                 micro_batch_tokens=micro_batch_tokens))


def test_a_checkpointed_step_with_a_kl_term_and_the_emulated_low_precision_experts_is_the_step_without() -> None:
    model = seeded_model(small_config(), seed=1)
    model.set_experts_fn(make_experts_fn(ExpertsPrecision.EMULATED))
    _steps(model, TrainerSection(lr=1e-3, ratio_cap=1.05, kl_coef=0.05, micro_batch_tokens=29))


def _packed(model: MoETransformer) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    prompts = random_prompts(3, model.config.vocab_size, 12, 20, seed=4)
    batch = pack_sequences(prompts)
    gen = torch.Generator().manual_seed(5)
    replay = torch.stack([torch.randperm(model.config.num_experts, generator=gen)[:model.config.num_experts_per_tok]
                          for _ in range(batch.num_tokens * model.config.num_hidden_layers)])
    return batch.input_ids_T, list(batch.seq_lens), replay.view(batch.num_tokens, model.config.num_hidden_layers, -1)


@pytest.mark.parametrize("replayed", [True, False], ids=["replay", "live"])
def test_the_recompute_routes_with_the_forwards_experts_and_records_nothing(
        monkeypatch: pytest.MonkeyPatch, replayed: bool) -> None:
    model = seeded_model(small_config(num_hidden_layers=3), seed=2).train()
    ids_T, seq_lens, replay_TLK = _packed(model)
    kwargs = dict(seq_lens=seq_lens, replay_topk_ids_TLK=replay_TLK if replayed else None)
    plain = model(ids_T, **kwargs)
    plain.logits.square().sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    decisions, experts_ids, gate_calls = [], [], [0]
    route = moe.route
    monkeypatch.setattr(moe, "route", lambda *a, **k: decisions.append(1) or route(*a, **k))
    fn = model.experts_fn
    model.set_experts_fn(lambda x, ids, *rest: experts_ids.append(ids.clone()) or fn(x, ids, *rest))
    num_layers = model.config.num_hidden_layers

    def scrambled(module: torch.nn.Module, args: object, logits: torch.Tensor) -> torch.Tensor | None:
        # the recompute's router scores turned upside down: a router that chose anew would pick other experts
        gate_calls[0] += 1
        return -logits if gate_calls[0] > num_layers else None

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(scrambled)
    model.set_activation_checkpointing(True)
    out = model(ids_T, **kwargs)
    assert len(decisions) == num_layers and len(experts_ids) == num_layers
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
    assert torch.equal(out.topk_ids_TLK, plain.topk_ids_TLK) and out.layer_stats == plain.layer_stats
    out.logits.square().sum().backward()
    assert gate_calls[0] == 2 * num_layers, "every layer was recomputed in the backward"
    assert len(decisions) == num_layers, "the recompute decided no routing (nor counted any) again"
    # the recompute ran each layer's experts with the ids its forward chose, the deepest layer first
    assert len(experts_ids) == 2 * num_layers
    for forward, recomputed in zip(experts_ids[:num_layers], reversed(experts_ids[num_layers:]), strict=True):
        assert torch.equal(forward, recomputed)
    # the scrambled scores gave the gates other values: only the routing is pinned, the gradients follow the
    # recomputed graph (the hook stands for a non-deterministic kernel, not for anything the model does)
    assert any(not torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True))


def test_checkpointed_gradients_are_those_without() -> None:
    model = seeded_model(small_config(num_hidden_layers=3), seed=2).train()
    ids_T, seq_lens, replay_TLK = _packed(model)
    grads = []
    for enabled in (False, True):
        model.zero_grad(set_to_none=True)
        model.set_activation_checkpointing(enabled)
        out = model(ids_T, seq_lens=seq_lens, replay_topk_ids_TLK=replay_TLK)
        out.logits.square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # a forward without grad keeps nothing: it runs as without checkpointing
        assert model(ids_T, seq_lens=seq_lens).logits.grad_fn is None


@pytest.mark.parametrize("expert_parallel", [1, 2], ids=["2dp", "2ep"])
def test_checkpointed_ranks_take_the_step_one_rank_takes(tmp_path: Path, expert_parallel: int) -> None:
    # 2 ranks in micro-batches (one of them masked); expert-parallel ones recompute each layer's all-to-alls in the
    # backward, both in the same order
    one_state, one_metrics = rank_worker.step_once(RankLayout(), replay=True)
    out, rendezvous = tmp_path / "many.pt", tmp_path / "rdzv"
    rank_worker.launch(rank_worker.main, (2, expert_parallel, True, 0.0, str(rendezvous), str(out), 29, True), 2)
    many = torch.load(out)
    assert_same_step(one_state, one_metrics, many["state"], many["metrics"])
