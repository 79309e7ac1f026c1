"""A slow environment on purpose: seeded, heavy-tailed delays added where an environment is waited on.

Real agent environments answer slowly and unevenly (remote sandboxes, package installs, test suites whose
run time has a long tail), while the built-in tasks answer in milliseconds. A `LatencyModel` adds a delay
drawn from a lognormal distribution before a tool call's result or a grading's outcome, so a run on this
machine can rehearse that regime (and the asynchronous pipeline can be measured in it).

Each delay is a pure function of the model's seed and a key naming the wait (the sample, its attempt and
which call), not of the order in which waits happen: two runs of the same prompts, one synchronous and one
asynchronous, meet the same delay at the same tool call of the same sample. The draw uses the standard
library alone (``random.Random`` seeded from a SHA-256 of seed and key): the processes that read the run's
configuration include the reconciler, which loads no numpy.

The wait is ``asyncio.sleep``: it blocks no event loop, and a caller cancelling it (a drain) ends it at once.

For a lognormal of median m and shape σ (the standard deviation of its logarithm), the q-quantile is
m·exp(z_q·σ); p99 / median = exp(2.326·σ): 20× at σ = 1.288, 33× at σ = 1.5. Its mean is m·exp(σ²/2).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["DISTRIBUTIONS", "LatencyModel"]

DISTRIBUTIONS = ("off", "lognormal")


@dataclass(frozen=True)
class LatencyModel:
    """Delays of one kind of wait (tool calls, or gradings).

    Attributes:
        distribution: ``off`` (no delay) or ``lognormal``.
        median_s: the median delay in seconds.
        sigma: the lognormal's shape (the standard deviation of the delay's logarithm); 0 makes every
            delay the median.
        max_s: no delay is longer (a lognormal is unbounded; an environment's own timeout is not).
        seed: with the key, determines every delay.
    """

    distribution: str = "off"
    median_s: float = 1.0
    sigma: float = 1.5
    max_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"LatencyModel.distribution={self.distribution!r}: use one of {', '.join(DISTRIBUTIONS)}")
        for name in ("median_s", "sigma", "max_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LatencyModel.{name}={value!r} must be a finite number >= 0")
        if self.max_s < self.median_s:
            raise ValueError(f"LatencyModel.max_s={self.max_s} is below median_s={self.median_s}: "
                             "raise max_s (the cap would move the median)")

    @property
    def enabled(self) -> bool:
        return self.distribution != "off" and self.median_s > 0

    def quantile(self, q: float) -> float:
        """The q-quantile of one delay in seconds (the cap applied), from the distribution's formula."""
        if not 0 < q < 1:
            raise ValueError(f"quantile q={q} must be within (0, 1)")
        if not self.enabled:
            return 0.0
        return min(self.max_s, self.median_s * math.exp(NormalDist().inv_cdf(q) * self.sigma))

    def draw(self, key: str) -> float:
        """The delay in seconds of the wait named ``key``: the same key and seed, the same delay."""
        if not self.enabled:
            return 0.0
        digest = hashlib.sha256(f"{self.seed}\x00{key}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:16], "big"))
        return min(self.max_s, rng.lognormvariate(math.log(self.median_s), self.sigma))

    async def wait(self, key: str) -> float:
        """Sleeps the delay of ``key`` (cancellable) and returns it."""
        delay = self.draw(key)
        if delay > 0:
            await asyncio.sleep(delay)
        return delay
