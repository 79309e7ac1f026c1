"""RL and SFT losses over packed batches.

Legend: T packed tokens, V vocabulary, G samples in a group.

Policy gradient (Dr. GRPO with truncated importance sampling), per token t of a sampled completion:

    r_t   = exp(logp_t - logp_behaviour_t)                  importance ratio vs the policy that sampled
    w_t   = min(r_t, ratio_cap)                             truncated importance weight
    pg_t  = -sg(w_t / r_t) * r_t * A_t                      value -w_t * A_t, gradient -w_t * A_t * grad logp_t
    kl_t  = logp_t - logp_ref_t                             k1 estimator of KL(pi || pi_ref)
    loss  = sum_t mask_t * (pg_t + kl_coef * kl_t) / loss_normalizer

`loss_normalizer` is a constant (e.g. the token budget of a batch), never the number of tokens of a
sequence or of the batch, so every token has the same weight no matter how long its sequence is.
(sg = stop-gradient: the truncated weight scales the score function but is not differentiated, as in
truncated importance sampling; where r_t < ratio_cap the loss is exactly -r_t * A_t.)
A_t is the sequence's Dr. GRPO advantage: reward minus the group's mean reward (no std division).
"""

from __future__ import annotations

import dataclasses

import torch

from model.errors import ConfigError
from model.packing import PackedBatch
from model.router import RouterReplayConfig
from model.transformer import ModelOutput, MoETransformer

__all__ = [
    "PolicyLossConfig",
    "PolicyLossMetrics",
    "advantages_dr_grpo",
    "packed_logprobs",
    "policy_loss",
    "sft_forward_backward",
    "token_entropy",
    "token_logprobs",
]


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
        if self.ratio_cap < 1.0:
            raise ConfigError(f"PolicyLossConfig.ratio_cap must be >= 1, got {self.ratio_cap}")
        if self.kl_coef < 0:
            raise ConfigError(f"PolicyLossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.loss_normalizer <= 0:
            raise ConfigError(f"PolicyLossConfig.loss_normalizer must be > 0, got {self.loss_normalizer}")


@dataclasses.dataclass(frozen=True)
class PolicyLossMetrics:
    """Means over masked tokens (floats, detached)."""

    num_tokens: int
    pg_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    entropy: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def token_logprobs(logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per token, in fp32 (fp64 stays fp64)."""
    return torch.log_softmax(_at_least_fp32(logits_TV), dim=-1).gather(1, targets_T[:, None].long())[:, 0]


def token_entropy(logits_TV: torch.Tensor) -> torch.Tensor:
    """Entropy of each token's next-token distribution, in fp32 (fp64 stays fp64)."""
    logp = torch.log_softmax(_at_least_fp32(logits_TV), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def advantages_dr_grpo(rewards_G: torch.Tensor) -> torch.Tensor:
    """Reward minus the group mean (Dr. GRPO: no division by the group's std).

    A group whose rewards are all equal gets exactly 0 (not a rounding residue of the mean), so callers
    can recognise samples without a learning signal by ``advantage == 0``.
    """
    rewards = rewards_G if rewards_G.dtype == torch.float64 else rewards_G.float()
    if rewards.numel() and bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return rewards - rewards.mean()


def packed_logprobs(
    model: MoETransformer,
    batch: PackedBatch,
    replay_topk_ids_TLK: torch.Tensor | None = None,
    replay: RouterReplayConfig | None = None,
) -> tuple[torch.Tensor, ModelOutput]:
    """Log-prob of each packed token's next token (0 where `target_mask_T` is False) and the output."""
    out = model(batch.input_ids_T, seq_lens=batch.seq_lens, replay_topk_ids_TLK=replay_topk_ids_TLK, replay=replay)
    logp = token_logprobs(out.logits, batch.targets_T) * batch.target_mask_T
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
    """The Dr. GRPO / truncated-IS loss of the module docstring, and its metrics."""
    mask = mask_T.to(logprobs_T.dtype)
    ratio_grad = torch.exp(logprobs_T - behaviour_logprobs_T.detach())
    ratio = ratio_grad.detach()
    weight = ratio.clamp(max=config.ratio_cap)
    pg = -(weight / ratio) * ratio_grad * advantages_T.to(logprobs_T.dtype)
    per_token = pg
    kl = torch.zeros_like(logprobs_T)
    if ref_logprobs_T is not None:
        kl = logprobs_T - ref_logprobs_T.detach()
        if config.kl_coef:
            per_token = per_token + config.kl_coef * kl
    loss = (per_token * mask).sum() / config.loss_normalizer
    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        sel = mask_T.bool()
        metrics = PolicyLossMetrics(
            num_tokens=int(mask.sum()),
            pg_loss=float((pg * mask).sum() / config.loss_normalizer),
            kl=float((kl * mask).sum() / n),
            clip_fraction=float(((ratio > config.ratio_cap) & sel).sum() / n),
            ratio_mean=float((ratio * mask).sum() / n),
            ratio_min=float(ratio[sel].min()) if sel.any() else 1.0,
            ratio_max=float(ratio[sel].max()) if sel.any() else 1.0,
            entropy=float((entropy_T * mask).sum() / n) if entropy_T is not None else float("nan"),
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
