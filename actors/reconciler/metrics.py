"""Metrics of the lifecycle core and the plain snapshot `python -m ops.status` prints.

Counters and bounded reservoirs only; no clock reads (the caller passes `now`), no global state.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["LifecycleMetrics", "LifecycleSnapshot", "StageLatency"]


@dataclasses.dataclass(frozen=True, slots=True)
class StageLatency:
    """Seconds from issuing a stage's work (queue time included) to its accepted completion."""

    p50_s: float
    p99_s: float
    count: int


@dataclasses.dataclass(frozen=True)
class LifecycleSnapshot:
    """A point-in-time summary of the slot table and its figures; `to_dict` is msgpack/JSON-ready.

    Attributes:
        slots_per_state: number of slots in each state (all states present).
        stage_latency: per stage, over the last `reservoir` completions.
        admissions: ``admitted`` groups, and for each bound the number of admission checks it blocked.
        batch_waits: number of batch selections that waited, by reason.
        lag_histogram: trainer version − token version at hand-out, per trained sample.
        samples_per_s, groups_per_s: trained, over the last `window_s` seconds.
        counters: run totals (trained, failed, dropped, retries, ignored completions, ...).
    """

    time: float
    trainer_version: int
    cursor_epoch: int
    cursor_position: int
    slots_per_state: Mapping[str, int]
    stage_latency: Mapping[str, StageLatency]
    admissions: Mapping[str, int]
    batch_waits: Mapping[str, int]
    lag_histogram: Mapping[int, int]
    samples_per_s: float
    groups_per_s: float
    counters: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["lag_histogram"] = {str(k): v for k, v in sorted(self.lag_histogram.items())}
        return out


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


class LifecycleMetrics:
    """Accumulates what `LifecycleSnapshot` reports."""

    def __init__(self, *, window_s: float = 60.0, reservoir: int = 4096) -> None:
        if window_s <= 0 or reservoir < 1:
            raise ValueError(f"window_s must be > 0 and reservoir >= 1, got {window_s}, {reservoir}")
        self._window_s = window_s
        self._reservoir = reservoir
        self._latency: dict[str, collections.deque[float]] = {}
        self._admissions: collections.Counter[str] = collections.Counter()
        self._batch_waits: collections.Counter[str] = collections.Counter()
        self._lag: collections.Counter[int] = collections.Counter()
        self._trained: collections.deque[tuple[float, int, int]] = collections.deque()
        self.counters: collections.Counter[str] = collections.Counter()

    def record_latency(self, stage: str, seconds: float) -> None:
        samples = self._latency.get(stage)
        if samples is None:
            samples = self._latency[stage] = collections.deque(maxlen=self._reservoir)
        samples.append(max(0.0, seconds))

    def record_admission(self, admitted: int, blocked_by: str) -> None:
        if admitted:
            self._admissions["admitted"] += admitted
        else:
            self._admissions[f"blocked_{blocked_by}"] += 1

    def record_batch_wait(self, reason: str) -> None:
        self._batch_waits[reason] += 1

    def record_lag(self, lag: int, num_samples: int = 1) -> None:
        self._lag[lag] += num_samples

    def record_trained(self, now: float, num_samples: int, num_groups: int) -> None:
        self._trained.append((now, num_samples, num_groups))
        self.counters["trained_samples"] += num_samples
        self.counters["trained_groups"] += num_groups
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._trained and self._trained[0][0] < now - self._window_s:
            self._trained.popleft()

    def lag_histogram(self) -> dict[int, int]:
        return dict(self._lag)

    def snapshot(
        self,
        *,
        now: float,
        trainer_version: int,
        cursor: tuple[int, int],
        slots_per_state: Mapping[str, int],
    ) -> LifecycleSnapshot:
        self._expire(now)
        latency = {}
        for stage, samples in self._latency.items():
            ordered = sorted(samples)
            latency[stage] = StageLatency(_percentile(ordered, 0.5), _percentile(ordered, 0.99), len(ordered))
        span = self._window_s
        if self._trained:
            span = min(self._window_s, max(now - self._trained[0][0], 1e-9))
        return LifecycleSnapshot(
            time=now,
            trainer_version=trainer_version,
            cursor_epoch=cursor[0],
            cursor_position=cursor[1],
            slots_per_state=dict(slots_per_state),
            stage_latency=latency,
            admissions=dict(self._admissions),
            batch_waits=dict(self._batch_waits),
            lag_histogram=dict(self._lag),
            samples_per_s=sum(n for _, n, _ in self._trained) / span,
            groups_per_s=sum(g for _, _, g in self._trained) / span,
            counters=dict(self.counters),
        )
