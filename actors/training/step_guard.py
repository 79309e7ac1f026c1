"""Non-finite numbers never reach the weights: the learner's checks on a step's inputs, loss, gradient
and update, and the rollback that makes a refused update leave no trace.

A step is checked at four points, each before the next one can do harm:

1. inputs: every sample's reward and advantage, every token's behaviour log-prob and temperature (trained
   or not), as the float32 the step computes with, over every sample of the batch (with a signal or not);
2. loss: the loss of the forward (a non-finite per-token log-prob names its sample);
3. gradient: the total gradient norm (each sample's own backward then says which samples overflow);
4. update: every parameter and Adam moment after the optimizer step; a non-finite one restores the
   pre-step copy (`Rollback`), so the weights and moments are those of the last good step.

With several ranks each verdict is the group's, whatever a rank's share of the batch (none, or tokens none
of which is trained): the inputs are the same batch on every rank, and the loss, gradient and update
verdicts are all-reduced (actors.training.ranks), so every rank refuses or applies the same step.

A failed check makes the step a `NonFiniteStep`: the learner applies nothing, names the offending samples
in a `step_skipped_non_finite` event and in the step's metrics, and the checkpoint it saves next holds
the last good weights (a save of non-finite weights is refused outright).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence

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
    """Every segment holds tokens, and every per-token field, and the router choices, is as long as
    ``token_ids`` (a field missing altogether is refused when the group record is read: actors.records).

    Raises:
        ValueError: naming the sample and the fields.
    """
    for s in samples:
        if not s.trajectory.segments:
            raise ValueError(f"sample {s.sample_id}: a trajectory without segments")
        for i, t in enumerate(s.trajectory.segments):
            if not t.token_ids:  # it would fail the packing of one rank's share only, the others left waiting
                raise ValueError(f"sample {s.sample_id} segment {i}: a segment without tokens")
            lengths = {k: len(getattr(t, k)) for k in PER_TOKEN_FIELDS}
            if set(lengths.values()) != {len(t.token_ids)}:
                raise ValueError(f"sample {s.sample_id} segment {i}: {len(t.token_ids)} tokens but per-token fields "
                                 f"of lengths {lengths}")
            if t.topk_ids_TLK is None or t.topk_ids_TLK.shape[0] < len(t.token_ids):
                shape = None if t.topk_ids_TLK is None else list(t.topk_ids_TLK.shape)
                raise ValueError(f"sample {s.sample_id} segment {i}: {len(t.token_ids)} tokens but router choices "
                                 f"of shape {shape}")


def non_finite_inputs(samples: Sequence[GroupSample]) -> NonFiniteStep | None:
    """The samples whose reward, advantage, or any token's behaviour log-prob or temperature is unusable.

    Every sample of the batch is checked, with or without a signal, and every token, trained or not: a
    value is unusable as the step computes with it (float32: a temperature of 1e-50 is 0 there, a log-prob
    of -1e39 is -inf), and a token outside the loss mask records 0.0 and 1.0 (actors.agent.episode), so
    anything else there is a corrupt record, not a value to train around.
    """
    bad: list[str] = []
    reasons: list[str] = []
    for s in samples:
        why = []
        if not math.isfinite(s.reward):
            why.append(f"reward={s.reward}")
        if not bool(torch.isfinite(torch.tensor(s.advantage, dtype=torch.float32))):
            why.append(f"advantage={s.advantage}")
        for i, t in enumerate(s.trajectory.segments):
            for name, values, usable in (("behaviour log-prob", t.behaviour_logprobs, _a_logprob),
                                         ("temperature", t.logprob_temperatures, _a_temperature)):
                found = _first_unusable(values, usable)
                if found is not None:
                    j, count = found
                    trained = "trained" if t.loss_mask[j] else "not trained"
                    why.append(f"{name} {values[j]!r} at segment {i} token {j} ({trained}; {count} such in the "
                               f"segment)")
        if why:
            bad.append(s.sample_id)
            reasons.append(f"{s.sample_id}: {', '.join(why)}")
    if not bad:
        return None
    return NonFiniteStep(NonFiniteStage.INPUT, tuple(bad), "; ".join(reasons))


def _a_logprob(values: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(values) & (values <= 0.0)


def _a_temperature(values: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(values) & (values > 0.0)


def _first_unusable(values: Sequence[float], usable: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, int] | None:
    """The index of the first of ``values`` that is not ``usable`` as float32, and how many are not."""
    unusable = (~usable(torch.tensor(values, dtype=torch.float32))).nonzero().flatten()
    return (int(unusable[0]), int(unusable.numel())) if unusable.numel() else None


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
