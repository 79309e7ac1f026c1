"""Per-request sampling: temperature, top-p, seeded draws, and the log-probs of the sampling distribution.

Legend: B sequences in a step, V vocabulary.

Every row is processed on its own (no cross-row reduction), and each request draws from its own seeded
`torch.Generator` with one uniform per token, so a sequence's samples do not depend on its batch
companions.

A token is drawn from the tempered distribution softmax(logits / T) restricted to the top-p nucleus and
renormalised. The log-prob recorded for it (the behaviour log-prob the trainer's importance ratio is
taken against) is that of the *untruncated* tempered distribution, `tempered_logprobs`: the trainer
scores the token with the same function of its own logits and the same T, so on-policy the ratio is
exactly 1 for any temperature and top-p. The top-p rule: the nucleus is a sampling-time filter that the
trainer does not model; the ratio corrects for the policy changing between sampling and training, not
for the truncation (the support of a nucleus is not a differentiable function of the weights, and a
token outside the trainer's nucleus would get an infinite log-ratio). With temperature 0 (greedy) the
token is the argmax and the recorded log-prob is the temperature-1 one; `logprob_temperature` says which
temperature a request's log-probs are taken at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from model.errors import ConfigError

__all__ = ["SamplingParams", "logprob_temperature", "sample_tokens", "sampling_logprobs", "tempered_logprobs"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Args:
        max_new_tokens: generation stops after this many tokens.
        temperature: 0 means greedy.
        top_p: nucleus mass kept (1 keeps everything).
        seed: seeds this request's generator; None draws a seed from the engine's generator.
        stop_token_ids: generation stops after emitting one of these (it is included in the output).
        stop_strings: generation stops once the decoded completion contains one (needs a detokenizer).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"SamplingParams.max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop_strings):
            raise ConfigError("SamplingParams.stop_strings must not contain an empty string")


def logprob_temperature(params: SamplingParams) -> float:
    """The temperature a request's recorded log-probs are taken at (1 for greedy decoding)."""
    return params.temperature if params.temperature > 0 else 1.0


def tempered_logprobs(logits_BV: torch.Tensor, temperatures_B: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) per row, in fp32 (fp64 stays fp64): the recorded behaviour log-probs.

    The one definition the sampler records with and the trainer scores with, so that the two agree bit
    for bit on equal logits. ``temperatures_B`` holds each row's temperature (> 0).
    """
    logits = logits_BV if logits_BV.dtype == torch.float64 else logits_BV.float()
    return torch.log_softmax(logits / temperatures_B.to(logits.dtype)[:, None], dim=-1)


def sampling_logprobs(logits_BV: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float]) -> torch.Tensor:
    """Log-probs (B, V) of the distributions tokens are drawn from (-inf outside each row's nucleus)."""
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperature], dtype=torch.float32)
    return _nucleus(tempered_logprobs(logits_BV, temps), temperature, top_p)


def _nucleus(logp_BV: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float]) -> torch.Tensor:
    """``logp_BV`` restricted to each sampled row's top-p nucleus and renormalised."""
    nucleus = [tp < 1.0 and t > 0 for t, tp in zip(temperature, top_p, strict=True)]
    if not any(nucleus):
        return logp_BV
    tps = torch.tensor([tp if n else 2.0 for tp, n in zip(top_p, nucleus, strict=False)], dtype=torch.float32)
    sorted_logp, order = logp_BV.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < tps[:, None]  # the token crossing top_p stays
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return torch.log_softmax(logp_BV.masked_fill(~keep, float("-inf")), dim=-1)


def sample_tokens(
    logits_BV: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row with its own params and generator; returns tokens and their behaviour
    log-probs (under the untruncated tempered distribution, see the module docstring).

    Greedy rows take the argmax and draw nothing from their generator; every sampled row draws exactly one
    uniform per token. The whole batch is handled in a fixed number of tensor ops (no per-row indexing).
    """
    temps = [p.temperature for p in params]
    tempered_BV = tempered_logprobs(logits_BV, torch.tensor([logprob_temperature(p) for p in params]))
    sampled = [t > 0 for t in temps]
    tokens_B = logits_BV.argmax(dim=-1)
    if any(sampled):
        logp_BV = _nucleus(tempered_BV, temps, [p.top_p for p in params])
        draws = zip(generators, sampled, strict=True)
        u_B = torch.tensor([float(torch.rand((), generator=g)) if s else 0.0 for g, s in draws], dtype=torch.float32)
        cdf_BV = logp_BV.exp().cumsum(-1)
        drawn_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
        drawn_B = drawn_B.clamp(max=logits_BV.shape[1] - 1)
        tokens_B = torch.where(torch.tensor(sampled), drawn_B, tokens_B)
        # rounding at the top end of the cdf can land past the nucleus: step down to the last kept token
        outside_B = logp_BV.gather(1, tokens_B[:, None])[:, 0] == float("-inf")
        for b in outside_B.nonzero()[:, 0].tolist():
            token = int(tokens_B[b])
            while logp_BV[b, token] == float("-inf"):
                token -= 1
            tokens_B[b] = token
    return tokens_B.tolist(), tempered_BV.gather(1, tokens_B[:, None])[:, 0].tolist()
