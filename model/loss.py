"""RL and SFT losses over packed batches.

Legend: T packed tokens, V vocabulary, G samples in a group.

Policy gradient (Dr. GRPO with truncated importance sampling), per token t of a sampled completion:

    d_t   = logp_t - logp_behaviour_t                       log importance ratio vs the policy that sampled
    r_t   = exp(d_t)                                        importance ratio
    w_t   = exp(min(d_t, log ratio_cap)) = min(r_t, cap)    truncated importance weight
    pg_t  = -sg(w_t) * exp(d_t - sg(d_t)) * A_t             value -w_t * A_t, gradient -w_t * A_t * grad logp_t
    kl_t  = logp_t - logp_ref_t                             k1 estimator of KL(pi || pi_ref)
    loss  = sum_t mask_t * (pg_t + kl_coef * kl_t) / loss_normalizer

`loss_normalizer` is a constant (e.g. the token budget of a batch), never the number of tokens of a
sequence or of the batch, so every token has the same weight no matter how long its sequence is.
(sg = stop-gradient: the truncated weight scales the score function but is not differentiated, as in
truncated importance sampling; where r_t < ratio_cap the loss is exactly -r_t * A_t.)
A_t is the sequence's Dr. GRPO advantage: reward minus the group's mean reward (no std division).

Everything is computed from the log-ratio d_t, never from r_t: exp(d - sg(d)) is exactly 1 with the
gradient of d, and w_t is at most ratio_cap, so any finite log-probs (a behaviour log-prob of -101
against a current -1, or -120 that underflows r_t to 0) give a finite loss and gradient. (The textbook
form sg(w/r)·r is 0·inf or 0/0 there, and one such token turns the whole step into NaN.)

logp_t is scored under the distribution the token was sampled from: log softmax(logits / T_t) with the
temperature T_t the rollout recorded (model.sampling states the rule, top-p included), so that on-policy
r_t is exactly 1 at any temperature and top-p.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from model.errors import ConfigError
from model.packing import PackedBatch
from model.router import RouterReplayConfig
from model.sampling import tempered_logprobs
from model.transformer import ModelOutput, MoETransformer

__all__ = [
    "PolicyLossConfig",
    "PolicyLossMetrics",
    "combine_metrics",
    "packed_logprobs",
    "policy_loss",
    "sft_forward_backward",
    "token_entropy",
    "token_logprobs",
]


_ENTROPY_ROWS = 256  # 256 x a 49k vocabulary: 50 MB of fp32 per intermediate


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Args:
    ratio_cap: truncation C of the importance ratio (>= 1).
    kl_coef: weight of the k1 KL term (0 disables it).
    loss_normalizer: the constant the token sum is divided by (e.g. max tokens per batch).
    """

    ratio_cap: float = 2.0
    kl_coef: float = 0.0
    loss_normalizer: float = 4096.0

    def __post_init__(self) -> None:
        # written so that NaN fails each test (every comparison with NaN is False)
        if not 1.0 <= self.ratio_cap < math.inf:
            raise ConfigError(f"PolicyLossConfig.ratio_cap must be >= 1 and finite, got {self.ratio_cap}")
        if not 0.0 <= self.kl_coef < math.inf:
            raise ConfigError(f"PolicyLossConfig.kl_coef must be >= 0 and finite, got {self.kl_coef}")
        if not 0.0 < self.loss_normalizer < math.inf:
            raise ConfigError(f"PolicyLossConfig.loss_normalizer must be > 0 and finite, got {self.loss_normalizer}")


@dataclasses.dataclass(frozen=True)
class PolicyLossMetrics:
    """Means over masked tokens (floats, detached); the ratio's mean, median and extremes are over the same
    tokens (inf where a log-ratio exceeds float range: reported, never clamped away)."""

    num_tokens: int
    pg_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    ratio_median: float
    entropy: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def combine_metrics(parts: Sequence[tuple[PolicyLossMetrics, torch.Tensor]]) -> PolicyLossMetrics:
    """The metrics of a batch from those of its disjoint parts (micro-batches, ranks' shares), each with the
    importance ratios of its trained tokens: the loss is a sum over a constant, so pg_loss adds up; the
    per-token means are weighted by each part's tokens; the ratio's statistics are over every part's ratios.
    A part without trained tokens (a masked forward) changes nothing."""
    n = sum(m.num_tokens for m, _ in parts)
    every = torch.cat([r.detach().cpu() for _, r in parts])

    def mean(field: str) -> float:
        return sum(getattr(m, field) * m.num_tokens for m, _ in parts if m.num_tokens) / max(n, 1)

    return PolicyLossMetrics(
        num_tokens=n, pg_loss=sum(m.pg_loss for m, _ in parts), kl=mean("kl"),
        clip_fraction=mean("clip_fraction"),
        ratio_mean=float(every.mean()) if every.numel() else 1.0,
        ratio_min=float(every.min()) if every.numel() else 1.0,
        ratio_max=float(every.max()) if every.numel() else 1.0,
        ratio_median=float(every.median()) if every.numel() else 1.0,
        entropy=mean("entropy") if n else float("nan"))


def _temperatures(
    logits_TV: torch.Tensor, temperatures_T: torch.Tensor | None, scored_T: torch.Tensor | None
) -> torch.Tensor:
    """Each row's temperature, 1 where not given and at every row outside ``scored_T``.

    A row the caller does not score (a prompt or tool-output token) may record any temperature, 0 or NaN
    included: it is replaced *before* the division, because afterwards no mask can undo it. Its log-probs
    would be NaN, and log_softmax's backward writes grad - softmax * sum(grad) into the row: 0 - NaN * 0,
    NaN on every weight, although the row's own gradient is exactly 0.
    """
    if temperatures_T is None:
        return torch.ones(logits_TV.shape[0], dtype=torch.float32, device=logits_TV.device)
    if scored_T is None:
        return temperatures_T
    return torch.where(scored_T.bool(), temperatures_T, torch.ones_like(temperatures_T))


def token_logprobs(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, temperatures_T: torch.Tensor | None = None,
    scored_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """log softmax(logits / T)[target] per token, in fp32 (fp64 stays fp64); T = 1 where not given, and at
    the rows outside ``scored_T`` (default: every row is scored), which the caller then ignores.

    The same function of the logits as the behaviour log-probs the sampler records (model.sampling).
    """
    logp = tempered_logprobs(logits_TV, _temperatures(logits_TV, temperatures_T, scored_T))
    return logp.gather(1, targets_T[:, None].long())[:, 0]


def token_entropy(
    logits_TV: torch.Tensor, temperatures_T: torch.Tensor | None = None, scored_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Entropy of each token's (tempered) next-token distribution, in fp32 (fp64 stays fp64); rows outside
    ``scored_T`` are taken at T = 1, as in `token_logprobs`.

    Computed over chunks of ``_ENTROPY_ROWS`` rows (each row's value does not depend on the others): its
    log-softmax, exp and product are three T x V fp32 tensors at once otherwise, as large as everything
    the loss's own forward holds of the vocabulary."""
    temperatures = _temperatures(logits_TV, temperatures_T, scored_T)
    parts = []
    for start in range(0, logits_TV.shape[0], _ENTROPY_ROWS):
        logp = tempered_logprobs(logits_TV[start:start + _ENTROPY_ROWS], temperatures[start:start + _ENTROPY_ROWS])
        parts.append(-(logp.exp() * logp).sum(dim=-1))
    return torch.cat(parts) if parts else logits_TV.new_zeros(0, dtype=torch.float32)


def packed_logprobs(
    model: MoETransformer,
    batch: PackedBatch,
    replay_topk_ids_TLK: torch.Tensor | None = None,
    replay: RouterReplayConfig | None = None,
    temperatures_T: torch.Tensor | None = None,
    scored_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ModelOutput]:
    """Log-prob of each packed token's next token at the positions ``scored_T`` (default: every position with
    a next token, `target_mask_T`), 0 elsewhere, and the output.

    ``temperatures_T[p]`` is the temperature the next token of position p was sampled at (default 1); it is
    read only where p is scored, so what an unscored position records cannot reach the gradient.
    """
    scored = batch.target_mask_T if scored_T is None else scored_T.bool() & batch.target_mask_T
    out = model(batch.input_ids_T, seq_lens=batch.seq_lens, replay_topk_ids_TLK=replay_topk_ids_TLK, replay=replay)
    logp = token_logprobs(out.logits, batch.targets_T, temperatures_T, scored).masked_fill(~scored, 0.0)
    return logp, out


def policy_loss(
    logprobs_T: torch.Tensor,
    behaviour_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    config: PolicyLossConfig,
    ref_logprobs_T: torch.Tensor | None = None,
    entropy_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """The Dr. GRPO / truncated-IS loss of the module docstring, and its metrics.

    Finite for any finite log-probs (computed from the log-ratio); a non-finite log-prob gives a
    non-finite loss, which the caller must detect (it is never hidden here).
    """
    sel = mask_T.bool()
    dtype = logprobs_T.dtype
    # masked-out positions (prompt, tool output, padding) may hold anything: they are replaced before any
    # arithmetic, so that neither their value nor their gradient can be 0 * inf
    log_ratio = torch.where(sel, logprobs_T - behaviour_logprobs_T.detach().to(dtype), 0.0)
    log_ratio_sg = log_ratio.detach()
    weight = torch.exp(log_ratio_sg.clamp(max=math.log(config.ratio_cap)))
    pg = -weight * torch.exp(log_ratio - log_ratio_sg) * advantages_T.to(dtype)
    per_token = pg
    kl = torch.zeros_like(logprobs_T)
    if ref_logprobs_T is not None:
        kl = torch.where(sel, logprobs_T - ref_logprobs_T.detach().to(dtype), 0.0)
        if config.kl_coef:
            per_token = per_token + config.kl_coef * kl
    # where, not a product with the mask: a masked-out position must not reach the sum even as 0 * inf
    loss = torch.where(sel, per_token, 0.0).sum() / config.loss_normalizer
    with torch.no_grad():
        ratio = torch.exp(log_ratio_sg[sel])
        n = max(int(sel.sum()), 1)
        metrics = PolicyLossMetrics(
            num_tokens=int(sel.sum()),
            pg_loss=float(torch.where(sel, pg, 0.0).sum() / config.loss_normalizer),
            kl=float(kl[sel].sum() / n),
            clip_fraction=float((ratio > config.ratio_cap).sum() / n),
            ratio_mean=float(ratio.mean()) if ratio.numel() else 1.0,
            ratio_min=float(ratio.min()) if ratio.numel() else 1.0,
            ratio_max=float(ratio.max()) if ratio.numel() else 1.0,
            ratio_median=float(ratio.median()) if ratio.numel() else 1.0,
            entropy=float(entropy_T[sel].sum() / n) if entropy_T is not None else float("nan"),
        )
    return loss, metrics


def sft_forward_backward(
    model: MoETransformer, batch: PackedBatch, loss_normalizer: float, loss_mask_T: torch.Tensor | None = None
) -> float:
    """Next-token cross-entropy summed over (masked) tokens / `loss_normalizer`; calls backward.

    Optimizer-agnostic: gradients accumulate in `.grad`; the caller steps and zeroes its optimizer.
    Returns the mean loss per counted token (for logging).
    """
    logp, _ = packed_logprobs(model, batch)
    mask = batch.target_mask_T if loss_mask_T is None else batch.target_mask_T & loss_mask_T.bool()
    total = -(logp * mask).sum()
    (total / loss_normalizer).backward()
    return float(total.detach()) / max(int(mask.sum()), 1)
