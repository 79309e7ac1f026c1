"""The trainer's process group as the learner sees it: which sequences this rank computes, and the
collectives that make N ranks take the step one rank would.

World of W ranks, expert parallel degree E (E divides W): ranks ``[g*E, (g+1)*E)`` form expert group g
and hold one copy of all experts between them (rank r holds shard r mod E); every rank holds the dense
parameters. Each step:

- sequences: the batch's samples with a signal are assigned to ranks by model.packing.assign_to_ranks
  (attention-aware LPT on n*linear + n^2*quadratic), the same plan on every rank; a rank left without a
  sequence computes a fully masked copy of one, so it still joins every collective (its loss and gradient
  are exactly 0).
- gradients: the loss is a token sum over a constant (Dr. GRPO), so the batch's gradient is the *sum* of
  the ranks' gradients: dense gradients are all-reduced (sum) over the world, expert gradients over the
  ranks that hold the same shard (none when E = W: the all-to-all's backward already brought every
  token's contribution home). Plain all-reduce, not FSDP2: the dense part of a MoE is small next to its
  experts (which expert parallelism already shards), the step guard's rollback, the non-finite checks,
  the HF checkpoint and the weight publisher all want whole dense tensors on every rank, and gloo's
  reduce-scatter/all-gather per layer would double the number of collectives for no memory we need.
- clipping: the norm over all parameters = dense norm (equal everywhere after the reduction) and the
  expert norms summed over the expert group; the ranks then agree on one norm (its maximum over the
  ranks, non-finite if any rank's is), so every rank scales by the same factor and judges it alike.
- decisions (a non-finite loss, gradient or update) are all-reduced, so every rank refuses or applies
  the same step, and meets the same collectives after it, whatever its share: none, or only untrained
  tokens (a rank that computed nothing of its own names no sample but still joins the gather).
- devices: on CUDA the group has NCCL for CUDA tensors and gloo for CPU ones (actors.trainer_group), so
  each collective's tensor says which carries it: gradients, their norms and the experts' all-to-all stay
  on the model's device (NCCL); flags, sums and objects (plans, records, metrics) are on the CPU (gloo).

Single rank (``RankGroup.single()``): no collective at all, the learner's path of before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from model.expert_parallel import ExpertShard, shard_experts
from model.loss import PolicyLossMetrics, combine_metrics
from model.packing import SequenceCost, assign_to_ranks
from model.router import RoutingStats
from model.transformer import MoETransformer
from model.weight_sync.sharding import rank_part

__all__ = ["RankGroup", "RankLayout", "weights_to_publish"]

T = TypeVar("T")
_STACKED_TO_PROJ = {"w_gate_EFD": "gate_proj", "w_up_EFD": "up_proj", "w_down_EDF": "down_proj"}

_EXPERT_PARAMS = ("w_gate_EFD", "w_up_EFD", "w_down_EDF")
_OBJECTS = torch.device("cpu")  # where object collectives run: gloo's side of the group on every device


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Rank ``rank`` of ``world_size``, experts spread over groups of ``expert_parallel`` ranks."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must lie in [0, world_size={self.world_size})")
        if self.expert_parallel < 1 or self.world_size % self.expert_parallel:
            raise ValueError(f"trainer.expert_parallel={self.expert_parallel} must divide the number of trainer "
                             f"ranks ({self.world_size})")

    @property
    def expert_index(self) -> int:
        return self.rank % self.expert_parallel

    @property
    def expert_group_ranks(self) -> list[int]:
        first = self.rank - self.expert_index
        return list(range(first, first + self.expert_parallel))

    def replica_ranks(self, expert_index: int) -> list[int]:
        """The ranks holding the same expert shard (one per expert group)."""
        return list(range(expert_index, self.world_size, self.expert_parallel))


def is_expert_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _EXPERT_PARAMS


class RankGroup:
    """The learner's collectives over an initialised ``torch.distributed`` world (or none for one rank)."""

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout
        self.expert_group = None
        self.replica_group = None
        if layout.world_size > 1:
            if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
                raise RuntimeError(f"RankGroup for {layout.world_size} ranks needs torch.distributed initialised "
                                   "with that world size")
            e = layout.expert_parallel
            # every rank creates every subgroup, in the same order (torch.distributed's rule)
            for g in range(layout.world_size // e):
                group = dist.new_group(list(range(g * e, (g + 1) * e)))
                if layout.rank // e == g:
                    self.expert_group = group
            for i in range(e):
                group = dist.new_group(layout.replica_ranks(i))
                if layout.expert_index == i:
                    self.replica_group = group

    @classmethod
    def single(cls) -> RankGroup:
        return cls(RankLayout())

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    def prepare(self, model: MoETransformer) -> MoETransformer:
        """This rank's copy of ``model``: its expert shard only, when experts are spread."""
        if self.layout.expert_parallel == 1:
            return model
        shard = ExpertShard(model.config.num_experts, self.layout.expert_parallel, self.layout.expert_index)
        return shard_experts(model, shard, self.expert_group)

    def my_share(self, lengths: Sequence[int], cost: SequenceCost) -> list[int]:
        """Indices of the sequences this rank computes (the same plan on every rank)."""
        if not self.distributed:
            return list(range(len(lengths)))
        return sorted(assign_to_ranks(lengths, self.layout.world_size, cost)[self.layout.rank])

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def broadcast_plan(self, plan: T | None) -> T | None:
        """Rank 0's ``plan`` (what to train next; None: stop) on every rank; the others pass None."""
        if not self.distributed:
            return plan
        box = [plan if self.layout.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=_OBJECTS)
        return box[0]

    def read_share(self, keys: Sequence[str], read: Callable[[str], T]) -> list[T]:
        """Every record of ``keys``, in order, on every rank; each rank reads only its share from storage
        (keys[i] by rank i mod W) and the group exchanges them."""
        if not self.distributed:
            return [read(k) for k in keys]
        return self.exchange({i: read(keys[i]) for i in self.share_of(len(keys))}, len(keys))

    def share_of(self, num_items: int) -> range:
        """The indices of ``num_items`` this rank reads (i mod W = rank)."""
        return range(self.layout.rank, num_items, self.layout.world_size)

    def exchange(self, mine: dict[int, T], num_items: int) -> list[T]:
        """Every rank's share put together, in index order, on every rank."""
        if not self.distributed:
            return [mine[i] for i in range(num_items)]
        merged: dict[int, T] = {}
        for part in self.gather(mine):
            merged.update(part)  # type: ignore[arg-type]
        return [merged[i] for i in range(num_items)]

    def gather(self, obj: object) -> list[object]:
        if not self.distributed:
            return [obj]
        out: list[object] = [None] * self.layout.world_size
        dist.all_gather_object(out, obj)  # on the CPU (gloo) when the group has a CPU backend, as ours always does
        return out

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum every gradient over the ranks that hold the same parameter (see the module docstring)."""
        if not self.distributed:
            return
        dense, experts = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                (experts if is_expert_param(name) else dense).append(p.grad)
        _all_reduce_flat(dense, None)
        if self.layout.world_size > self.layout.expert_parallel:
            _all_reduce_flat(experts, self.replica_group)

    def clip_gradients(self, model: torch.nn.Module, max_norm: float) -> float:
        """Scale all gradients so that their global norm is at most ``max_norm``; returns the norm before."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not self.distributed:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        device = params[0].device if params else torch.device("cpu")  # the sums' all-reduce runs where the grads are
        dense_sq = torch.zeros((), dtype=torch.float64, device=device)
        expert_sq = torch.zeros((), dtype=torch.float64, device=device)
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            sq = torch.linalg.vector_norm(p.grad).double() ** 2
            if is_expert_param(name) and self.layout.expert_parallel > 1:
                expert_sq += sq
            else:
                dense_sq += sq
        if self.layout.expert_parallel > 1:
            dist.all_reduce(expert_sq, group=self.expert_group)
        total = self._agreed_norm(torch.sqrt(dense_sq + expert_sq))
        coef = max_norm / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
        if coef < 1.0 and math.isfinite(total):
            torch._foreach_mul_([p.grad for p in params], coef)
        return total

    def _agreed_norm(self, norm: torch.Tensor) -> float:
        """The gradient norm every rank clips by and judges finite: the ranks' norms are equal up to the order
        of float sums (expert groups all-reduce their own), so the group takes their maximum, and NaN or inf
        if any rank's is (a MAX all-reduce may drop a NaN: gloo's is std::max, so it is sent as a flag)."""
        local = float(norm)
        finite = math.isfinite(local)
        agreed = torch.tensor([0.0 if finite else 1.0, local if finite else 0.0], dtype=torch.float64,
                              device=norm.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if agreed[0] > 0:
            return local if not finite else math.nan
        return float(agreed[1])

    def combine_loss_metrics(self, local: PolicyLossMetrics, ratios: torch.Tensor) -> PolicyLossMetrics:
        """The batch's metrics from every rank's (``ratios``: this rank's importance ratios, trained tokens)."""
        if not self.distributed:
            return local
        return combine_metrics(self.gather((local, ratios.detach().cpu())))  # type: ignore[arg-type]

    def combine_routing(self, stats: RoutingStats) -> RoutingStats:
        parts = self.gather(stats)
        return sum(parts[1:], parts[0])  # type: ignore[arg-type,return-value]


def weights_to_publish(model: MoETransformer, layout: RankLayout) -> dict[str, torch.Tensor]:
    """The tensors rank ``layout.rank`` publishes of each version (model.weight_sync: every rank uploads its
    part, readers assemble all parts). Dense tensors are split over all ranks by bytes (``rank_part``:
    each encodes and uploads 1/W); experts held by a rank of the first expert group go out under their
    per-expert HF names with their global index (``checked_state`` turns the assembled names back into
    this model's). Without expert parallelism every tensor is dense."""
    state = model.state_dict()
    if layout.world_size == 1:  # a lone rank publishes every tensor
        return state
    if layout.expert_parallel == 1:
        return rank_part(state, layout.rank, layout.world_size)
    dense = {n: t for n, t in state.items() if not is_expert_param(n)}
    out = rank_part(dense, layout.rank, layout.world_size)
    shard = getattr(model, "expert_shard", None)
    if shard is not None and layout.rank < layout.expert_parallel:
        for name, tensor in state.items():
            if is_expert_param(name):
                prefix, stacked = name.rsplit(".", 1)
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.experts.{shard.first + e}.{_STACKED_TO_PROJ[stacked]}.weight"] = tensor[e]
    return out


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """One all-reduce (sum) of many gradients through a flat buffer."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
