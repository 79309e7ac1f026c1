"""Non-finite numbers never reach the weights: the learner's checks on a step's inputs, loss, gradient
and update, and the rollback that makes a refused update leave no trace.

A step is checked at four points, each before the next one can do harm:

1. inputs: every trained token's behaviour log-prob and temperature, every sample's advantage;
2. loss: the loss of the forward (a non-finite per-token log-prob names its sample);
3. gradient: the total gradient norm (each sample's own backward then says which samples overflow);
4. update: every parameter and Adam moment after the optimizer step; a non-finite one restores the
   pre-step copy (`Rollback`), so the weights and moments are those of the last good step.

A failed check makes the step a `NonFiniteStep`: the learner applies nothing, names the offending samples
in a `step_skipped_non_finite` event and in the step's metrics, and the checkpoint it saves next holds
the last good weights (a save of non-finite weights is refused outright).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import torch

from actors.records import GroupSample

__all__ = ["NonFiniteStage", "NonFiniteStep", "NonFiniteWeights", "Rollback", "check_trajectories",
           "non_finite_inputs", "non_finite_parameters", "sample_ids", "samples_at_positions"]

PER_TOKEN_FIELDS = ("loss_mask", "behaviour_logprobs", "logprob_temperatures", "versions")


class NonFiniteStage(enum.StrEnum):
    INPUT = "input"
    LOSS = "loss"
    GRADIENT = "gradient"
    UPDATE = "update"


@dataclasses.dataclass(frozen=True)
class NonFiniteStep:
    """Why a step was not applied: where the non-finite value appeared and which samples carry it."""

    stage: NonFiniteStage
    sample_ids: tuple[str, ...]
    detail: str


class NonFiniteWeights(ArithmeticError):
    """Weights with a NaN or inf were about to be saved as a checkpoint."""


def sample_ids(samples: Sequence[GroupSample]) -> tuple[str, ...]:
    return tuple(s.sample_id for s in samples)


def check_trajectories(samples: Sequence[GroupSample]) -> None:
    """Every per-token field, and the router choices, as long as ``token_ids`` (a field missing altogether
    is refused when the group record is read: actors.records).

    Raises:
        ValueError: naming the sample and the fields.
    """
    for s in samples:
        if not s.trajectory.segments:
            raise ValueError(f"sample {s.sample_id}: a trajectory without segments")
        for i, t in enumerate(s.trajectory.segments):
            lengths = {k: len(getattr(t, k)) for k in PER_TOKEN_FIELDS}
            if set(lengths.values()) != {len(t.token_ids)}:
                raise ValueError(f"sample {s.sample_id} segment {i}: {len(t.token_ids)} tokens but per-token fields "
                                 f"of lengths {lengths}")
            if t.topk_ids_TLK is None or t.topk_ids_TLK.shape[0] < len(t.token_ids):
                shape = None if t.topk_ids_TLK is None else list(t.topk_ids_TLK.shape)
                raise ValueError(f"sample {s.sample_id} segment {i}: {len(t.token_ids)} tokens but router choices "
                                 f"of shape {shape}")


def non_finite_inputs(samples: Sequence[GroupSample]) -> NonFiniteStep | None:
    """The samples whose advantage, or a trained token's behaviour log-prob or temperature, is unusable."""
    bad: list[str] = []
    reasons: list[str] = []
    for s in samples:
        segments = s.trajectory.segments
        behaviour = [t.behaviour_logprobs[j] for t in segments for j, keep in enumerate(t.loss_mask) if keep]
        temps = [t.logprob_temperatures[j] for t in segments for j, keep in enumerate(t.loss_mask) if keep]
        why = []
        if not math.isfinite(s.advantage):
            why.append(f"advantage={s.advantage}")
        if not all(math.isfinite(lp) and lp <= 0.0 for lp in behaviour):
            why.append("behaviour log-prob not finite or > 0")
        if not all(math.isfinite(x) and x > 0.0 for x in temps):
            why.append("temperature not finite or <= 0")
        if why:
            bad.append(s.sample_id)
            reasons.append(f"{bad[-1]}: {', '.join(why)}")
    if not bad:
        return None
    return NonFiniteStep(NonFiniteStage.INPUT, tuple(bad), "; ".join(reasons))


def samples_at_positions(positions_T: torch.Tensor, seq_lens: Sequence[int],
                         samples: Sequence[GroupSample]) -> tuple[str, ...]:
    """Ids of the samples that own the True positions of ``positions_T`` (in packing order); ``samples`` names
    the sample of each packed sequence (a chain's segments are several sequences of one sample)."""
    owner = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    return tuple(dict.fromkeys(samples[i].sample_id for i in owner[positions_T.cpu()].unique().tolist()))


def non_finite_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """Names of the parameters (and Adam moments) holding a NaN or inf.

    One fused max-norm over all tensors and one device sync when everything is finite (the common case);
    the names are looked up only when something is not.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    if optimizer is not None:
        named += [(f"{names.get(id(p), '?')}.{key}", value) for p, state in optimizer.state.items()
                  for key, value in state.items()
                  if torch.is_tensor(value) and value.is_floating_point() and value.numel()]
    if not named:
        return []
    by_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault((t.device, t.dtype), []).append(i)
    finite = [True] * len(named)
    for indices in by_device.values():
        # the max-norm of a tensor is NaN or inf exactly when one of its elements is
        norms = torch._foreach_norm([named[i][1] for i in indices], float("inf"))
        flags = torch.stack(norms).isfinite()
        if not bool(flags.all()):
            for i, ok in zip(indices, flags.tolist(), strict=True):
                finite[i] = ok
    return [n for (n, _), ok in zip(named, finite, strict=True) if not ok]


class Rollback:
    """A copy of the parameters and optimizer state taken just before a step, to restore if the step's
    update is refused. Costs one copy of the weights and the Adam moments while the step runs."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        with torch.no_grad():
            self.params = [p.detach().clone() for p in model.parameters()]
        self.state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()}

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in zip(self.model.parameters(), self.params, strict=True):
                p.copy_(saved)
        self.optimizer.state.clear()
        for p, s in self.state.items():
            self.optimizer.state[p] = s
