"""Top-k softmax routing, and router replay with a plausibility filter.

Legend: T tokens, E experts, K experts per token.

Live routing (Qwen3-MoE): p = softmax(router_logits) in fp32; the K largest p are the experts, their p
the gates, renormalised to sum to 1 when `norm_topk_prob`.

Replay (R3, "rollout routing replay"): the trainer routes with the expert ids recorded by the generation
engine, so training and inference use the same experts. The rule, per token:

1. Validation. A record is valid when all K ids lie in [0, E) and are distinct. A row of all -1 means
   "not recorded"; any other invalid row is counted as invalid. Both fall back to live routing.
2. Plausibility filter. Let p_k be the router's own K-th largest probability for the token. A replayed
   expert e with p[e] < factor * p_k is implausible under the current weights (the recorded choice most
   likely came from a numerically different or stale model). Each implausible expert is replaced by the
   router's best candidate not already chosen (not among the kept replayed experts nor earlier
   replacements), taking candidates in descending p and slots in order. For factor <= 1 every
   replacement passes the filter itself: at least r live top-K experts remain unchosen when r slots are
   replaced, and each has p >= p_k. factor = 0 disables the filter.
3. Gates are gathered from the dense probabilities p at the final ids (never from a top-k-masked
   vector, which would give replayed experts the router did not pick a zero gate and no gradient), then
   renormalised when `norm_topk_prob`. Gradients therefore reach the router weights for every expert used.

`RoutingStats` counts replayed tokens, invalid records and replacements; callers log
`replaced_fraction` (replacements / replayed expert slots).
"""

from __future__ import annotations

import dataclasses

import torch

from model.errors import ConfigError

__all__ = ["RouterReplayConfig", "Routing", "RoutingStats", "gates_at", "route"]


@dataclasses.dataclass(frozen=True)
class RouterReplayConfig:
    """How recorded expert ids are replayed.

    Args:
        plausibility_factor: a replayed expert whose router probability is below this factor times the
            router's own K-th best probability is replaced (0 disables the filter; at most 1).
    """

    plausibility_factor: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.plausibility_factor <= 1.0:
            raise ConfigError(
                f"RouterReplayConfig.plausibility_factor must be in [0, 1], got {self.plausibility_factor}; "
                "0 disables the filter, 1 replaces anything the live router would not pick"
            )


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    """Replay counters of one or more MoE layers (all zero without replay)."""

    num_tokens: int = 0
    num_replayed_tokens: int = 0
    num_invalid_tokens: int = 0
    num_unrecorded_tokens: int = 0
    num_replaced: int = 0
    top_k: int = 1

    @property
    def replaced_fraction(self) -> float:
        """Replaced expert slots over replayed expert slots (0 when nothing was replayed)."""
        slots = self.num_replayed_tokens * self.top_k
        return self.num_replaced / slots if slots else 0.0

    def __add__(self, other: RoutingStats) -> RoutingStats:
        return RoutingStats(
            num_tokens=self.num_tokens + other.num_tokens,
            num_replayed_tokens=self.num_replayed_tokens + other.num_replayed_tokens,
            num_invalid_tokens=self.num_invalid_tokens + other.num_invalid_tokens,
            num_unrecorded_tokens=self.num_unrecorded_tokens + other.num_unrecorded_tokens,
            num_replaced=self.num_replaced + other.num_replaced,
            top_k=max(self.top_k, other.top_k),
        )

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = dataclasses.asdict(self)
        out["replaced_fraction"] = self.replaced_fraction
        return out


@dataclasses.dataclass(frozen=True)
class Routing:
    """The experts (T, K) each token uses, their gates (T, K) and replay counters."""

    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    stats: RoutingStats


def _valid_records(replay_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid_T, recorded_T): in range and distinct; recorded = not an all -1 row."""
    recorded_T = (replay_TK != -1).any(dim=1)
    in_range_T = ((replay_TK >= 0) & (replay_TK < num_experts)).all(dim=1)
    sorted_TK = replay_TK.sort(dim=1).values
    distinct_T = (sorted_TK[:, 1:] != sorted_TK[:, :-1]).all(dim=1)
    return in_range_T & distinct_T, recorded_T


def _replay_ids(
    probs_TE: torch.Tensor,
    live_vals_TK: torch.Tensor,
    live_ids_TK: torch.Tensor,
    replay_TK: torch.Tensor,
    factor: float,
) -> tuple[torch.Tensor, RoutingStats]:
    num_tokens, num_experts = probs_TE.shape
    top_k = live_ids_TK.shape[1]
    replay_TK = replay_TK.to(device=probs_TE.device, dtype=torch.long)
    valid_T, recorded_T = _valid_records(replay_TK, num_experts)
    ids_TK = torch.where(valid_T[:, None], replay_TK, live_ids_TK)
    with torch.no_grad():
        threshold_T1 = factor * live_vals_TK[:, -1:]
        implausible_TK = (probs_TE.gather(1, ids_TK) < threshold_T1) & valid_T[:, None]
        num_replaced = int(implausible_TK.sum())
        if num_replaced:
            kept_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, ids_TK, ~implausible_TK)
            candidates_TK = probs_TE.masked_fill(kept_TE, -1.0).topk(top_k, dim=1).indices
            rank_TK = (implausible_TK.long().cumsum(dim=1) - 1).clamp(min=0)
            ids_TK = torch.where(implausible_TK, candidates_TK.gather(1, rank_TK), ids_TK)
    num_valid = int(valid_T.sum())
    num_recorded = int(recorded_T.sum())
    stats = RoutingStats(
        num_tokens=num_tokens,
        num_replayed_tokens=num_valid,
        num_invalid_tokens=num_recorded - num_valid,
        num_unrecorded_tokens=num_tokens - num_recorded,
        num_replaced=num_replaced,
        top_k=top_k,
    )
    return ids_TK, stats


def route(
    router_logits_TE: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    replay_topk_ids_TK: torch.Tensor | None = None,
    replay: RouterReplayConfig | None = None,
) -> Routing:
    """Choose K experts per token (live, or replayed per the module docstring) and their gates.

    Gates are returned in the logits' dtype, ids as int64.
    """
    probs_TE = torch.softmax(router_logits_TE, dim=-1, dtype=torch.float32)
    live_vals_TK, live_ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if replay_topk_ids_TK is None:
        ids_TK, gates_TK = live_ids_TK, live_vals_TK
        stats = RoutingStats(num_tokens=probs_TE.shape[0], top_k=top_k)
    else:
        if replay_topk_ids_TK.shape != live_ids_TK.shape:
            raise ValueError(
                f"replay_topk_ids_TK has shape {tuple(replay_topk_ids_TK.shape)}, expected {tuple(live_ids_TK.shape)}"
            )
        factor = (replay or RouterReplayConfig()).plausibility_factor
        ids_TK, stats = _replay_ids(probs_TE, live_vals_TK.detach(), live_ids_TK, replay_topk_ids_TK, factor)
        gates_TK = probs_TE.gather(1, ids_TK)
    if norm_topk_prob:
        gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
    return Routing(ids_TK, gates_TK.to(router_logits_TE.dtype), stats)


def gates_at(router_logits_TE: torch.Tensor, ids_TK: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The gates of experts ``ids_TK`` chosen beforehand: the values `route` gives them (its dense fp32
    probabilities at the ids, renormalised when `norm_topk_prob`), in the logits' dtype."""
    gates_TK = torch.softmax(router_logits_TE, dim=-1, dtype=torch.float32).gather(1, ids_TK)
    if norm_topk_prob:
        gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
    return gates_TK.to(router_logits_TE.dtype)
