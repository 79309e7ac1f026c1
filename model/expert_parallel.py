"""Expert parallelism: each rank of a group holds ``num_experts / E`` experts, and routed tokens travel to
their experts' ranks and back by all-to-all.

Legend: T tokens, K experts per token, D hidden size, S = T*K (token, slot) pairs, R rows a rank
receives, E_local experts on this rank.

One MoE layer on every rank of the expert group, in order (every rank calls every layer: the
collectives pair up by order, so a rank with no tokens still joins each exchange with zero rows):

1. dispatch: the S pairs, sorted by destination rank (expert // E_local, stable), send their token's
   hidden row and the expert's local index; an all-to-all of the per-rank counts first sizes the exchange.
2. compute: the rows received are run through the layer's own experts op with one expert per row and
   gate 1 (the reference, the emulated or the Triton NVFP4/MXFP8 op alike: the quantized op works per
   rank, on this rank's experts).
3. combine: results go back by the inverse all-to-all, return to (token, slot) order, are weighted by
   the gates (computed on the token's own rank, from the dense router scores: router replay unchanged)
   and summed over the K slots.

The all-to-all is ``torch.distributed.all_to_all_single`` with uneven splits, which gloo (torch >= 2.13,
checked) implements as well as NCCL; the backward of an all-to-all is the all-to-all of the gradients
the other way. Expert weights' gradients therefore hold every rank's tokens once backward is done: no
reduction is needed over the expert group (only over replicas of the same experts, if there are any).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from model.experts import ExpertsFn
from model.moe import MoEBlock
from model.transformer import MoETransformer

__all__ = ["ExpertShard", "expert_parallel_fn", "shard_experts"]

_STACKED = ("w_gate_EFD", "w_up_EFD", "w_down_EDF")


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """Experts ``[first, first + num_local)`` of ``num_experts`` live on shard ``index`` of ``num_shards``."""

    num_experts: int
    num_shards: int
    index: int

    def __post_init__(self) -> None:
        if self.num_shards < 1 or self.num_experts % self.num_shards:
            raise ValueError(f"expert_parallel={self.num_shards} must divide num_experts={self.num_experts}")
        if not 0 <= self.index < self.num_shards:
            raise ValueError(f"expert shard index {self.index} must lie in [0, {self.num_shards})")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_shards

    @property
    def first(self) -> int:
        return self.index * self.num_local


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of ``group`` by split sizes; the gradient goes back the way it came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _exchange_counts(send_counts: torch.Tensor, group) -> list[int]:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.tolist()


def expert_parallel_fn(shard: ExpertShard, local_fn: ExpertsFn, group=None) -> ExpertsFn:
    """An ``ExpertsFn`` over this rank's ``shard.num_local`` experts that serves the group's tokens.

    ``topk_ids_TK`` hold global expert ids; the weights passed are this rank's slices.
    """

    def forward(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF):  # the ExpertsFn signature
        num_tokens, top_k = topk_ids_TK.shape
        flat_S = topk_ids_TK.reshape(-1)
        dest_S = torch.div(flat_S, shard.num_local, rounding_mode="floor")
        order_S = torch.argsort(dest_S, stable=True)
        inverse_S = torch.empty_like(order_S)
        inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
        send_counts = torch.bincount(dest_S, minlength=shard.num_shards)
        send = send_counts.tolist()
        recv = _exchange_counts(send_counts, group)
        x_SD = x_TD.index_select(0, order_S // top_k)
        local_ids_S = (flat_S - dest_S * shard.num_local)[order_S]
        x_RD = _AllToAll.apply(x_SD, recv, send, group)
        ids_R = local_ids_S.new_empty(sum(recv))
        dist.all_to_all_single(ids_R, local_ids_S.contiguous(), recv, send, group=group)
        ones_R1 = x_RD.new_ones((x_RD.shape[0], 1))
        y_RD = local_fn(x_RD, ids_R[:, None], ones_R1, w_gate_EFD, w_up_EFD, w_down_EDF)
        y_SD = _AllToAll.apply(y_RD, send, recv, group)
        y_TKD = y_SD.index_select(0, inverse_S).view(num_tokens, top_k, -1)
        return (y_TKD * topk_weights_TK.to(x_TD.dtype).unsqueeze(-1)).sum(dim=1)

    return forward


def shard_experts(model: MoETransformer, shard: ExpertShard, group=None) -> MoETransformer:
    """Keep only ``shard``'s experts in every MoE layer of ``model`` (in place) and route through the group."""
    if model.config.num_experts != shard.num_experts:
        raise ValueError(f"the model has {model.config.num_experts} experts, the shard plan {shard.num_experts}")
    local_fn = model.experts_fn
    for module in model.modules():
        if isinstance(module, MoEBlock):
            for name in _STACKED:
                full = getattr(module, name)
                part = full.detach()[shard.first:shard.first + shard.num_local].clone()
                setattr(module, name, nn.Parameter(part, requires_grad=full.requires_grad))
    model.set_experts_fn(expert_parallel_fn(shard, local_fn, group))
    model.expert_shard = shard  # checkpoints and weight publishing name the experts by their global index
    return model
