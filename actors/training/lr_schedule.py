"""The trainer's learning-rate schedule: the learning rate of each step as a function of the policy version.

The step that takes the policy from version v to v + 1 uses ``lr_at(v)``. Being a function of the
version alone, the schedule needs no state of its own: a resumed run (whose learner starts at the
checkpoint's version) continues exactly where the stopped one was.

- ``constant``: every step uses the peak.
- ``cosine``: half a cosine from the peak at version 0 down to ``peak * min_ratio`` at the run's last
  step (version ``num_steps - 1``); later versions (a run resumed with more steps than its schedule
  was made for never reaches them: the schedule follows the run's ``run.steps``) stay at the minimum.
  A run without a step budget (``run.steps = 0``) has no last step to decay towards: the schedule is
  then constant, and ``LRSchedule.for_run`` logs ``lr_schedule_constant_fallback``.

The peak is the live key ``trainer.lr``: an operator's change rescales the whole schedule
(``with_peak``), so a run halfway through its cosine keeps its shape at the new height.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

__all__ = ["SCHEDULE_KINDS", "LRSchedule"]

SCHEDULE_KINDS = ("constant", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate per policy version.

    Args:
        kind: ``constant`` or ``cosine``.
        peak: the learning rate at version 0 (``trainer.lr``).
        min_ratio: cosine only: the last step's learning rate is ``peak * min_ratio``.
        num_steps: cosine only: the run's step budget; the decay ends at version ``num_steps - 1``.

    Raises:
        ValueError: an unknown kind, a peak <= 0, a min_ratio outside [0, 1], or a cosine without steps.
    """

    kind: str
    peak: float
    min_ratio: float = 0.0
    num_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"lr schedule kind={self.kind!r}: use one of {', '.join(SCHEDULE_KINDS)}")
        if not self.peak > 0:
            raise ValueError(f"lr schedule peak={self.peak} must be > 0")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"lr schedule min_ratio={self.min_ratio} must be in [0, 1]")
        if self.kind == "cosine" and self.num_steps < 1:
            raise ValueError(
                f"a cosine lr schedule needs num_steps >= 1, got {self.num_steps}; "
                "use kind='constant' for a run without a step budget"
            )

    @classmethod
    def for_run(cls, kind: str, peak: float, min_ratio: float, num_steps: int) -> LRSchedule:
        """The schedule of a run with ``num_steps`` steps (0: unbounded, where cosine falls back to constant)."""
        if kind == "cosine" and num_steps == 0:
            log.warning(
                "lr_schedule_constant_fallback",
                requested=kind,
                lr=peak,
                reason="run.steps = 0 (no step budget): a cosine has no last step to decay towards",
            )
            kind = "constant"
        return cls(kind, peak, min_ratio, num_steps)

    def with_peak(self, peak: float) -> LRSchedule:
        """The same schedule scaled to a new peak (a live change of ``trainer.lr``)."""
        return dataclasses.replace(self, peak=peak)

    def lr_at(self, version: int) -> float:
        """The learning rate of the step taken at policy ``version`` (the one producing ``version + 1``)."""
        if version < 0:
            raise ValueError(f"version={version} must be >= 0")
        if self.kind == "constant":
            return self.peak
        last = self.num_steps - 1
        progress = min(version / last, 1.0) if last > 0 else 0.0
        factor = self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak * factor
