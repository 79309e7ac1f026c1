"""Per-request sampling: temperature, top-p, seeded draws, and the log-probs of the sampling distribution.

Legend: B sequences in a step, V vocabulary.

Every row is processed on its own (no cross-row reduction), and each request draws from its own seeded
`torch.Generator` with one uniform per token, so a sequence's samples do not depend on its batch
companions. The log-prob recorded for a token is that of the distribution it was drawn from: softmax of
logits / temperature, restricted to the top-p nucleus and renormalised. With temperature 0 (greedy) the
token is the argmax and the recorded log-prob is the plain softmax (temperature 1) log-prob.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from model.errors import ConfigError

__all__ = ["SamplingParams", "sample_tokens", "sampling_logprobs"]


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


def sampling_logprobs(logits_BV: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float]) -> torch.Tensor:
    """Log-probs (B, V) of the distributions tokens are drawn from (-inf outside each row's nucleus)."""
    logits = logits_BV.float()
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperature], dtype=torch.float32)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    nucleus = [tp < 1.0 and t > 0 for t, tp in zip(temperature, top_p, strict=True)]
    if not any(nucleus):
        return logp
    tps = torch.tensor([tp if n else 2.0 for tp, n in zip(top_p, nucleus, strict=False)], dtype=torch.float32)
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < tps[:, None]  # the token crossing top_p stays
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)


def sample_tokens(
    logits_BV: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row with its own params and generator; returns tokens and their log-probs."""
    temps = [p.temperature for p in params]
    logp_BV = sampling_logprobs(logits_BV, temps, [p.top_p for p in params])
    u_B = torch.tensor([float(torch.rand((), generator=g)) for g in generators], dtype=torch.float32)
    cdf_BV = logp_BV.exp().cumsum(-1)
    drawn_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    drawn_B = drawn_B.clamp(max=logits_BV.shape[1] - 1)
    greedy_B = torch.tensor([t == 0 for t in temps])
    tokens_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), drawn_B)
    logprob_B = logp_BV.gather(1, tokens_B[:, None])[:, 0]
    tokens, logprobs = tokens_B.tolist(), logprob_B.tolist()
    for b, lp in enumerate(logprobs):
        while lp == float("-inf"):  # rounding at the top end of the cdf landed past the nucleus
            tokens[b] -= 1
            lp = float(logp_BV[b, tokens[b]])
        logprobs[b] = lp
    return tokens, logprobs
