"""How long an actor's handlings take: the age of the oldest one in hand, and the recent distribution.

The health checks' passive half (runtime.health) reads these from every ping: a handling that has run
far longer than this kind's recent ones is a hung engine or a wedged sandbox long before ``stuck_s``
(a limit set above the slowest legitimate step) would say so. Recent means the last ``window``
handlings that ended: the distribution follows the run (a trainer's steps grow with its batches).

Times are on a work clock that stops while the actor's writes wait out a full disk (``paused_s``: the blob
store's `space_waited_s`): that wait, up to the store's ``max_full_s`` (10 min), is the outage's, not the
handling's, and a handling held over it must not read as stuck (each kill would count a restart).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class WorkTiming:
    """Start and end times of one actor's handlings (cheap: two dict operations per handling)."""

    def __init__(self, window: int = 256, paused_s: Callable[[], float] | None = None) -> None:
        """``paused_s``: seconds the work clock stood still so far (module docstring); None: it never does."""
        self._paused_s = paused_s
        self._started: dict[int, float] = {}
        self._ids = itertools.count()
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def now(self) -> float:
        """The work clock: monotonic seconds, less the time it stood still (``paused_s``)."""
        return time.monotonic() - (self._paused_s() if self._paused_s is not None else 0.0)

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Times one handling: in hand while the block runs, a recent duration once it ends."""
        token = next(self._ids)
        start = self._started[token] = self.now()
        try:
            yield
        finally:
            del self._started[token]
            self._recent.append(self.now() - start)

    def oldest_in_hand_s(self) -> float:
        """Work-clock seconds the oldest handling in hand has run (0 with none in hand)."""
        return round(self.now() - min(self._started.values()), 3) if self._started else 0.0

    def recent_quantile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank) of the recent durations (0 with none yet)."""
        if not self._recent:
            return 0.0
        ordered = sorted(self._recent)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    @property
    def num_recent(self) -> int:
        return len(self._recent)
