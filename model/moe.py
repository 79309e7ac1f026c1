"""The sparse MoE block: router + stacked SwiGLU experts called through a swappable `ExpertsFn`.

Legend: T tokens, D hidden size, E experts, F expert intermediate size, K experts per token.

Expert weights are stored stacked — gate and up projections (E, F, D), down projection (E, D, F) — and
mapped to Hugging Face per-expert keys (`mlp.experts.{e}.gate_proj.weight`, ...) by `model.checkpoint`.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.experts import ExpertsFn, reference_experts_forward
from model.router import RouterReplayConfig, Routing, gates_at, route

__all__ = ["MoEBlock"]


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE `Qwen3MoeSparseMoeBlock` semantics)."""

    def __init__(self, config: ModelConfig, experts_fn: ExpertsFn = reference_experts_forward) -> None:
        super().__init__()
        e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(d, e, bias=False)
        self.w_gate_EFD = nn.Parameter(torch.empty(e, f, d))
        self.w_up_EFD = nn.Parameter(torch.empty(e, f, d))
        self.w_down_EDF = nn.Parameter(torch.empty(e, d, f))
        self.experts_fn: ExpertsFn = experts_fn

    def forward(
        self,
        x_TD: torch.Tensor,
        replay_topk_ids_TK: torch.Tensor | None = None,
        replay: RouterReplayConfig | None = None,
        pinned: list[Routing] | None = None,
    ) -> tuple[torch.Tensor, Routing]:
        """Route each token (live or replayed, see `model.router`) and mix its experts' outputs.

        ``pinned`` (activation checkpointing, model.activation_checkpoint): the choice is made once, by the
        first call, out of the graph, and kept in the list; a later call (the backward's recompute) routes with it
        and decides and counts nothing again. The gates are the same values either way (`gates_at`).
        """
        if pinned is None:
            routing = route(self.gate(x_TD), self.top_k, self.norm_topk_prob, replay_topk_ids_TK, replay)
        else:
            logits_TE = self.gate(x_TD)
            if not pinned:
                with torch.no_grad():
                    pinned.append(route(logits_TE.detach(), self.top_k, self.norm_topk_prob, replay_topk_ids_TK,
                                        replay))
            ids_TK = pinned[0].topk_ids_TK
            routing = Routing(ids_TK, gates_at(logits_TE, ids_TK, self.norm_topk_prob), pinned[0].stats)
        y_TD = self.experts_fn(
            x_TD, routing.topk_ids_TK, routing.topk_weights_TK, self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF
        )
        return y_TD, routing
