"""Supervised fine-tuning over examples made of (text, trained) segments.

Legend: T packed tokens.

An example is a list of segments; every token of a segment with ``trained=True`` is a target of the
next-token loss, every other token is context only. Examples are tokenized once, shuffled by the seed
each epoch, packed back to back without padding (`model.packing.pack_sequences`) and trained with AdamW,
linear warmup then cosine decay, and global-norm gradient clipping. The loss of a step is the mean
cross-entropy over its trained tokens.

This module knows nothing about tasks or sandboxes: callers turn their data into segments.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from model.errors import ConfigError
from model.loss import sft_forward_backward
from model.packing import PackedBatch, pack_sequences
from model.tokenizer import Tokenizer
from model.transformer import MoETransformer

__all__ = [
    "PretrainConfig",
    "PretrainResult",
    "Segment",
    "TokenizedExample",
    "learning_rate",
    "make_batch",
    "pretrain",
    "tokenize_example",
]

log = structlog.get_logger(__name__)

Segment = tuple[str, bool]


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Args:
    num_steps: optimizer steps.
    batch_size: examples packed into one step.
    lr: peak learning rate (reached after `warmup_steps`).
    min_lr: learning rate at the end of the cosine decay.
    warmup_steps: linear warmup from lr / warmup_steps.
    weight_decay: AdamW decoupled weight decay (not applied to norms and biases).
    betas: AdamW betas.
    grad_clip: global gradient-norm clip (0 disables).
    seed: seeds the example order.
    log_every: a `pretrain_progress` event every this many steps.
    """

    num_steps: int = 100
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PretrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.min_lr <= self.lr:
            raise ConfigError(f"PretrainConfig needs 0 < min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if not 0 <= self.warmup_steps <= self.num_steps:
            raise ConfigError(
                f"PretrainConfig.warmup_steps={self.warmup_steps} must be in [0, num_steps={self.num_steps}]"
            )
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError(
                f"PretrainConfig weight_decay={self.weight_decay} and grad_clip={self.grad_clip} must be >= 0"
            )
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"PretrainConfig.betas={self.betas} must both lie in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TokenizedExample:
    """Token ids of one example and, per token, whether it is a training target."""

    token_ids: tuple[int, ...]
    trained: tuple[bool, ...]

    @property
    def num_trained(self) -> int:
        return sum(self.trained)


@dataclasses.dataclass(frozen=True)
class PretrainResult:
    """The trained model (the one passed in, updated in place) and what training did."""

    model: MoETransformer
    losses: tuple[float, ...]
    num_steps: int
    num_examples: int
    num_tokens: int
    num_trained_tokens: int
    duration_s: float


def tokenize_example(segments: Sequence[Segment], tokenizer: Tokenizer) -> TokenizedExample:
    """Encode each segment on its own and concatenate; tokens inherit their segment's `trained` flag.

    Raises:
        ValueError: no tokens, or no trained token (the example would teach nothing).
    """
    ids: list[int] = []
    trained: list[bool] = []
    for text, is_trained in segments:
        seg = tokenizer.encode(text)
        ids += seg
        trained += [bool(is_trained)] * len(seg)
    if len(ids) < 2:
        raise ValueError(f"example {segments!r:.80} encodes to {len(ids)} token(s); it needs at least 2")
    if not any(trained[1:]):
        raise ValueError(f"example {segments!r:.80} has no trained token after its first; mark a segment trained")
    return TokenizedExample(tuple(ids), tuple(trained))


def make_batch(examples: Sequence[TokenizedExample]) -> tuple[PackedBatch, torch.Tensor]:
    """Pack examples; the loss mask (T,) is True at positions whose next token is a trained target."""
    batch = pack_sequences([e.token_ids for e in examples])
    mask = [flag for e in examples for flag in (*e.trained[1:], False)]
    return batch, torch.tensor(mask, dtype=torch.bool)


def learning_rate(step: int, config: PretrainConfig) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `num_steps` (step from 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.num_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def _optimizer(model: MoETransformer, config: PretrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith(("norm.weight", ".bias")) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, foreach=True)


def _batches(examples: Sequence[TokenizedExample], config: PretrainConfig) -> list[list[int]]:
    """Indices of each step's examples: seeded shuffles of the data, epoch after epoch."""
    rng = random.Random(config.seed)
    order: list[int] = []
    out: list[list[int]] = []
    for _ in range(config.num_steps):
        while len(order) < config.batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        out.append(order[: config.batch_size])
        order = order[config.batch_size :]
    return out


def pretrain(
    model: MoETransformer,
    examples: Sequence[Sequence[Segment]],
    tokenizer: Tokenizer,
    config: PretrainConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> PretrainResult:
    """Train `model` in place on `examples` (each a list of (text, trained) segments).

    Args:
        model: the policy to train (its current weights are the starting point).
        examples: the supervised data.
        tokenizer: turns segment text into token ids.
        config: optimisation settings.
        on_step: called with (step, loss) after every optimizer step (progress displays, tests).

    Raises:
        ValueError: `examples` is empty or one of them has no trained token.
    """
    if not examples:
        raise ValueError("pretrain needs at least one example")
    data = [tokenize_example(segments, tokenizer) for segments in examples]
    started = time.monotonic()
    optimizer = _optimizer(model, config)
    model.train()
    losses: list[float] = []
    num_tokens = num_trained = 0
    log.info("pretrain_started", num_examples=len(data), num_steps=config.num_steps, batch_size=config.batch_size)
    for step, indices in enumerate(_batches(data, config)):
        batch, mask_T = make_batch([data[i] for i in indices])
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        num_targets = int((mask_T & batch.target_mask_T).sum())
        loss = sft_forward_backward(model, batch, float(max(num_targets, 1)), mask_T)
        grad_norm = (
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)) if config.grad_clip else 0.0
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        num_tokens += batch.num_tokens
        num_trained += num_targets
        if on_step is not None:
            on_step(step, loss)
        if (step + 1) % config.log_every == 0 or step + 1 == config.num_steps:
            log.info(
                "pretrain_progress",
                step=step + 1,
                loss=round(loss, 4),
                lr=lr,
                grad_norm=round(grad_norm, 3),
                tokens=num_tokens,
                elapsed_s=round(time.monotonic() - started, 1),
            )
    model.eval()
    duration = time.monotonic() - started
    log.info("pretrain_finished", num_steps=config.num_steps, final_loss=losses[-1], duration_s=round(duration, 1))
    return PretrainResult(model, tuple(losses), config.num_steps, len(data), num_tokens, num_trained, duration)
