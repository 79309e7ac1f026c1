"""Activation checkpointing: a decoder layer's activations are not kept for the backward but recomputed in it.

Legend: T packed tokens, D hidden size, K experts per token.

Each layer then keeps only its input (T x D) from the forward to the backward, instead of everything its
attention, norms, router and experts save (~0.25 MB a token for a SmolLM2-sized layer); the backward runs the
layer's forward once more (torch.utils.checkpoint, non-reentrant): about one more forward of compute.

What the recompute must not change, and why it cannot:
- the experts. A MoE layer decides its top-k once, in the first forward, out of the graph (live or replayed,
  model.router), and the recompute routes with that decision (`MoEBlock.forward`'s ``pinned``): a router score
  that came out a rounding different the second time (a non-deterministic kernel) cannot send a token elsewhere.
  The gates are the router's probabilities at the chosen experts, computed in the graph both times: the same
  values, and the same gradients, as without checkpointing.
- what the forward records. The expert ids and replay counters a layer returns are those of the first forward;
  the recompute's are discarded and it decides (and counts) nothing.
- collectives inside a layer (expert parallelism's all-to-alls, model.expert_parallel). The recompute runs the
  whole layer, early stop off, so every rank meets each of its collectives; the backward reaches the layers in
  the same order on every rank (one graph, deepest layer first), so the recomputed exchanges pair up by order
  as the forward's do.
- low-precision experts (low_precision/): their quantisation is deterministic and their custom autograd op saves
  its operands through ``save_for_backward``, which the checkpoint intercepts as it does any saved tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from model.router import RouterReplayConfig, Routing

if TYPE_CHECKING:
    from model.attention import AttentionBatch
    from model.transformer import DecoderLayer

__all__ = ["checkpointed_layer"]


def checkpointed_layer(
    layer: DecoderLayer,
    h_TD: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch: AttentionBatch,
    replay_topk_ids_TK: torch.Tensor | None,
    replay: RouterReplayConfig | None,
) -> tuple[torch.Tensor, Routing | None]:
    """``layer(h_TD, ...)`` with its activations recomputed in the backward: its output and routing (None for a
    dense layer), both of the first forward."""
    pinned: list[Routing] = []

    def run(x_TD: torch.Tensor) -> torch.Tensor:
        out_TD, _ = layer(x_TD, cos, sin, batch, replay_topk_ids_TK, replay, pinned=pinned)
        return out_TD

    with set_checkpoint_early_stop(False):
        out_TD = checkpoint(run, h_TD, use_reentrant=False)
    return out_TD, (pinned[0] if pinned else None)
