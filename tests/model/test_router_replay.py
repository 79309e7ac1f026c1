"""Router replay: reproduces recorded routing, gradients reach the router, plausibility filter, validation."""

from __future__ import annotations

import copy

import pytest
import torch

from model.errors import ConfigError
from model.packing import pack_sequences
from model.router import RouterReplayConfig, route
from tests.model.helpers import random_prompts, seeded_model, small_config

CONFIG = small_config(num_experts=8, num_experts_per_tok=3)


def _packed_model_and_batch(seed: int = 0):
    model = seeded_model(CONFIG, seed=seed).train()
    batch = pack_sequences(random_prompts(3, CONFIG.vocab_size, 6, 14, seed=seed))
    return model, batch


def test_replay_of_own_routing_reproduces_forward_exactly() -> None:
    model, batch = _packed_model_and_batch()
    live = model(batch.input_ids_T, seq_lens=batch.seq_lens)
    replayed = model(batch.input_ids_T, seq_lens=batch.seq_lens, replay_topk_ids_TLK=live.topk_ids_TLK)
    assert torch.equal(replayed.topk_ids_TLK, live.topk_ids_TLK)
    assert torch.allclose(replayed.logits, live.logits, atol=1e-6, rtol=0)
    s = replayed.routing_stats
    assert s.num_replayed_tokens == batch.num_tokens * CONFIG.num_hidden_layers and s.num_replaced == 0


def test_replay_routes_with_recorded_experts_of_another_model() -> None:
    """Recorded from a slightly different model (rollout weights): training follows the record."""
    model, batch = _packed_model_and_batch(seed=1)
    rollout = copy.deepcopy(model)
    with torch.no_grad():
        for layer in rollout.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * 0.05)
    recorded = rollout(batch.input_ids_T, seq_lens=batch.seq_lens).topk_ids_TLK
    live = model(batch.input_ids_T, seq_lens=batch.seq_lens).topk_ids_TLK
    assert not torch.equal(recorded, live)
    out = model(
        batch.input_ids_T,
        seq_lens=batch.seq_lens,
        replay_topk_ids_TLK=recorded,
        replay=RouterReplayConfig(plausibility_factor=0.0),
    )
    assert torch.equal(out.topk_ids_TLK, recorded)


def test_gradients_reach_router_through_replayed_gates() -> None:
    model, batch = _packed_model_and_batch(seed=2)
    live = model(batch.input_ids_T, seq_lens=batch.seq_lens).topk_ids_TLK
    # replay experts the live router did NOT pick in slot 0 (all still valid and distinct)
    recorded = live.clone()
    recorded[..., 0] = (live.max(dim=-1).values + 1) % CONFIG.num_experts
    dup = (recorded[..., :1] == recorded[..., 1:]).any(-1)
    recorded[..., 0] = torch.where(dup, -1, recorded[..., 0])
    out = model(
        batch.input_ids_T,
        seq_lens=batch.seq_lens,
        replay_topk_ids_TLK=recorded,
        replay=RouterReplayConfig(plausibility_factor=0.0),
    )
    out.logits.square().mean().backward()
    for layer in model.model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0
        assert (grad.abs().sum(dim=1) > 0).all(), "every expert used somewhere gets router gradient"


def test_gates_gathered_from_dense_probs_and_normalised() -> None:
    logits = torch.randn(5, 6, requires_grad=True)
    replay = torch.tensor([[5, 4], [0, 1], [2, 3], [1, 0], [3, 5]])
    r = route(logits, 2, True, replay, RouterReplayConfig(0.0))
    probs = torch.softmax(logits.detach(), -1)
    expected = probs.gather(1, replay)
    assert torch.allclose(r.topk_weights_TK, expected / expected.sum(1, keepdim=True))
    r_raw = route(logits, 2, False, replay, RouterReplayConfig(0.0))
    assert torch.allclose(r_raw.topk_weights_TK, expected)
    r.topk_weights_TK[:, 0].sum().backward()
    assert logits.grad is not None
    # normalised gates depend on the chosen experts' logits only; each of them gets gradient
    assert (logits.grad.gather(1, replay).abs() > 0).all()
    logits.grad = None
    r_raw.topk_weights_TK.sum().backward()  # raw gates: the softmax couples every logit
    assert (logits.grad.abs() > 0).all()


def test_plausibility_filter_replaces_implausible_experts_and_reports_fraction() -> None:
    # token 0: probs sharply on experts 0,1; replay asks for 0 and 5 (5 is ~0 prob) -> 5 replaced by 1
    # token 1: replay asks for 2 and 3 which are the top-2 -> kept
    # token 2: replay asks for 4 and 5, both implausible -> replaced by best two (0 then 1)
    logits = torch.tensor(
        [
            [5.0, 4.0, 0.0, 0.0, 0.0, -9.0],
            [0.0, 0.0, 5.0, 4.5, 0.0, 0.0],
            [6.0, 5.0, 1.0, 0.0, -9.0, -9.0],
        ]
    )
    replay = torch.tensor([[0, 5], [2, 3], [4, 5]])
    r = route(logits, 2, True, replay, RouterReplayConfig(plausibility_factor=0.2))
    assert r.topk_ids_TK.tolist() == [[0, 1], [2, 3], [0, 1]]
    assert r.stats.num_replaced == 3 and r.stats.num_replayed_tokens == 3
    assert r.stats.replaced_fraction == pytest.approx(3 / 6)
    # factor 0 disables the filter
    assert route(logits, 2, True, replay, RouterReplayConfig(0.0)).topk_ids_TK.tolist() == replay.tolist()


def test_replacements_never_duplicate_kept_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 16, generator=gen) * 3
    replay = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(200)])
    r = route(logits, 4, True, replay, RouterReplayConfig(0.5))
    ids = r.topk_ids_TK
    assert (ids.sort(1).values[:, 1:] != ids.sort(1).values[:, :-1]).all()
    probs = torch.softmax(logits, -1)
    kth = probs.topk(4, dim=1).values[:, -1:]
    assert (probs.gather(1, ids) >= 0.5 * kth).all(), "after filtering every expert is plausible"
    kept = ids == replay
    assert int((~kept).sum()) == r.stats.num_replaced > 0


def test_invalid_records_fall_back_to_live_router() -> None:
    logits = torch.randn(5, 6)
    live = route(logits, 2, True).topk_ids_TK
    replay = torch.tensor([[1, 1], [0, 6], [-3, 2], [-1, -1], [4, 2]])  # dup, range, negative, none, ok
    r = route(logits, 2, True, replay, RouterReplayConfig(0.0))
    assert r.topk_ids_TK[:4].tolist() == live[:4].tolist()
    assert r.topk_ids_TK[4].tolist() == [4, 2]
    assert (r.stats.num_invalid_tokens, r.stats.num_unrecorded_tokens, r.stats.num_replayed_tokens) == (3, 1, 1)


def test_replay_shape_and_config_validation() -> None:
    with pytest.raises(ValueError, match="shape"):
        route(torch.randn(4, 6), 2, True, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match="plausibility_factor"):
        RouterReplayConfig(plausibility_factor=1.5)
