"""Supervised fine-tuning: loss masks, the schedule, determinism, and that the loss falls."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
import torch

from model.config import ModelConfig
from model.errors import ConfigError
from model.pretrain import PretrainConfig, learning_rate, make_batch, pretrain, tokenize_example
from model.tokenizer import ByteTokenizer
from model.transformer import MoETransformer

TOKENIZER = ByteTokenizer()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread: tiny matmuls gain nothing from two, and two collapse on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMALL = ModelConfig(
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
)


def _examples() -> list[list[tuple[str, bool]]]:
    return [
        [
            (f"<|user|>add {k}<|end|><|assistant|>", False),
            (f"x+{k}", True),
            ("<|end|><|tool|>ok<|end|>", False),
            ("done<|end|>", True),
        ]
        for k in (3, 17, 42, 90)
    ]


def test_tokenize_marks_trained_segments() -> None:
    ex = tokenize_example([("<|user|>ab", False), ("cd<|end|>", True)], TOKENIZER)
    assert ex.token_ids == (TOKENIZER.special_ids["<|user|>"], 97, 98, 99, 100, TOKENIZER.end_token_id)
    assert ex.trained == (False, False, False, True, True, True)
    assert ex.num_trained == 3


def test_tokenize_rejects_examples_that_teach_nothing() -> None:
    with pytest.raises(ValueError, match="no trained token"):
        tokenize_example([("prompt", False), ("answer", False)], TOKENIZER)
    with pytest.raises(ValueError, match="at least 2"):
        tokenize_example([("a", True)], TOKENIZER)


def test_batch_mask_targets_only_trained_tokens() -> None:
    a = tokenize_example([("ab", False), ("c", True)], TOKENIZER)
    b = tokenize_example([("x", False), ("yz", True), ("w", False)], TOKENIZER)
    batch, mask_T = make_batch([a, b])
    assert batch.seq_lens == (3, 4)
    # position t is counted when its target (token t+1 of the same sequence) is trained
    assert mask_T.tolist() == [False, True, False, True, True, False, False]
    counted_targets = batch.targets_T[mask_T & batch.target_mask_T].tolist()
    assert counted_targets == [ord("c"), ord("y"), ord("z")]


def test_loss_equals_hand_computed_masked_cross_entropy() -> None:
    model = MoETransformer(SMALL).init_weights(1)
    for p in model.parameters():
        p.requires_grad_(False)
    examples = [tokenize_example(e, TOKENIZER) for e in _examples()[:2]]
    config = PretrainConfig(num_steps=1, batch_size=2, lr=1e-9, min_lr=1e-9, warmup_steps=0, grad_clip=0.0)
    # reference: each sequence on its own, plain log-softmax, only tokens of trained segments as targets
    nll, count = 0.0, 0
    for ex in examples:
        ids = torch.tensor(ex.token_ids)
        logp = torch.log_softmax(model(ids).logits.double(), dim=-1)
        for t in range(len(ids) - 1):
            if ex.trained[t + 1]:
                nll -= float(logp[t, ids[t + 1]])
                count += 1
    for p in model.parameters():
        p.requires_grad_(True)
    # the same two examples, in whichever order the seeded shuffle puts them
    result = pretrain(model, _examples()[:2], TOKENIZER, config)
    assert result.num_trained_tokens == count
    assert result.losses[0] == pytest.approx(nll / count, rel=1e-4)


def test_untrained_segments_get_no_gradient_as_targets() -> None:
    """Changing what an untrained segment says after the last trained token changes no gradient."""
    grads = []
    for tail in ("<|end|>", "<|end|>something else entirely"):
        model = MoETransformer(SMALL).init_weights(2)
        config = PretrainConfig(num_steps=1, batch_size=1, lr=1e-3, min_lr=1e-3, warmup_steps=0)
        captured: list[torch.Tensor] = []
        model.lm_head.weight.register_hook(lambda g, c=captured: c.append(g.clone()))
        pretrain(model, [[("<|user|>q<|end|>", False), ("answer", True), (tail, False)]], TOKENIZER, config)
        grads.append(captured[0])
    # equal up to float summation order (the packed lengths differ); a trained tail would move them by ~1e-2
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


def test_schedule_warms_up_then_decays_to_min() -> None:
    config = PretrainConfig(num_steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert learning_rate(0, config) == pytest.approx(1e-4)
    assert learning_rate(9, config) == pytest.approx(1e-3)
    assert learning_rate(55, config) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(100, config) == pytest.approx(1e-4)
    rates = [learning_rate(s, config) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_loss_falls_and_runs_are_deterministic() -> None:
    config = PretrainConfig(num_steps=40, batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=5, seed=3)
    events: list[tuple[int, float]] = []
    first = pretrain(
        MoETransformer(SMALL).init_weights(0),
        _examples(),
        TOKENIZER,
        config,
        on_step=lambda s, loss: events.append((s, loss)),
    )
    second = pretrain(MoETransformer(SMALL).init_weights(0), _examples(), TOKENIZER, config)
    assert first.losses == second.losses
    assert [s for s, _ in events] == list(range(40))
    assert sum(first.losses[-5:]) / 5 < 0.3 * sum(first.losses[:5]) / 5
    assert first.num_examples == 4 and first.num_steps == 40
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_steps": 0}, "num_steps"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr"),
        ({"num_steps": 5, "warmup_steps": 6}, "warmup_steps"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"betas": (0.9, 1.0)}, "betas"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PretrainConfig(**kwargs)  # type: ignore[arg-type]


def test_pretrain_needs_examples() -> None:
    with pytest.raises(ValueError, match="at least one example"):
        pretrain(MoETransformer(SMALL).init_weights(0), [], TOKENIZER, PretrainConfig(num_steps=1, warmup_steps=0))
