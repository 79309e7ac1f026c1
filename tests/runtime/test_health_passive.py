"""The passive health checks read from ping replies: error rate over a window, a handling far outside the
kind's recent times. Pure functions of the replies: each rule's edges, and what must not trip them."""

from __future__ import annotations

import collections
import time

from runtime.health import _passive
from runtime.run_config import HealthSection
from runtime.work_timing import WorkTiming

CFG = HealthSection(error_window=3, max_error_rate=0.5, min_outcomes=10, outlier_factor=20.0, outlier_min_s=5.0,
                    outlier_min_samples=20, stuck_s=0.0)


def _reply(handled: int = 0, failed: int = 0, oldest: float = 0.0, p99: float = 0.0, n: int = 0) -> dict:
    return {"num_handled": handled, "num_failed": failed, "oldest_in_hand_s": oldest,
            "recent_handling_p99_s": p99, "num_recent_handlings": n}


def _verdicts(replies: list[dict], cfg: HealthSection = CFG) -> list:
    window: collections.deque = collections.deque(maxlen=cfg.error_window + 1)
    return [_passive(r, cfg, window) for r in replies]


def test_a_failing_majority_over_the_window_is_unhealthy() -> None:
    *quiet, last = _verdicts([_reply(100, 0), _reply(102, 5), _reply(103, 11)])
    assert quiet == [None, None]
    assert last is not None and last.check == "errors" and "11 of the last 14" in last.reason


def test_few_outcomes_or_old_failures_are_not_an_error_rate() -> None:
    assert _verdicts([_reply(0, 0), _reply(0, 9)])[-1] is None  # 9 < min_outcomes: a poison message's retries
    # 50 failures long ago, then a window of successes: the window, not the whole life, counts
    replies = [_reply(0, 50), _reply(40, 50), _reply(80, 50), _reply(120, 50), _reply(160, 51)]
    assert all(v is None for v in _verdicts(replies))
    assert _verdicts([_reply(0, 0), _reply(10, 10)])[-1] is None  # exactly the limit is not over it


def test_no_window_no_error_check() -> None:
    cfg = HealthSection(error_window=0)
    assert _verdicts([_reply(0, 0), _reply(0, 1000)], cfg) == [None, None]


def test_a_handling_far_outside_its_recent_times_is_stuck() -> None:
    (v,) = _verdicts([_reply(oldest=6.0, p99=0.2, n=50)])  # limit max(20 x 0.2, 5) = 5 s
    assert v is not None and v.check == "progress" and v.needs_kill and "p99" in v.reason


def test_slow_kinds_short_histories_and_the_floor_do_not_trip_the_outlier_check() -> None:
    assert _verdicts([_reply(oldest=50.0, p99=3.0, n=50)]) == [None]  # a kind whose steps are slow: 60 s limit
    assert _verdicts([_reply(oldest=60.0, p99=0.1, n=19)]) == [None]  # too few handlings to know the kind
    assert _verdicts([_reply(oldest=4.9, p99=0.01, n=500)]) == [None]  # under the floor
    assert _verdicts([_reply(oldest=1e6, p99=0.01, n=500)], HealthSection(outlier_factor=0.0, stuck_s=0.0)) == [None]


def test_the_absolute_bound_still_holds() -> None:
    cfg = HealthSection(stuck_s=10.0)
    (v,) = _verdicts([{"busy_without_progress_s": 11.0}], cfg)
    assert v is not None and v.check == "progress" and "without finishing any" in v.reason


def test_work_timing_ages_and_quantiles() -> None:
    timing = WorkTiming(window=4)
    assert timing.oldest_in_hand_s() == 0.0 and timing.recent_quantile(0.99) == 0.0
    with timing.handling():
        time.sleep(0.02)
        assert timing.oldest_in_hand_s() >= 0.02
    assert timing.oldest_in_hand_s() == 0.0 and timing.num_recent == 1
    for _ in range(10):
        with timing.handling():
            pass
    assert timing.num_recent == 4 and timing.recent_quantile(0.99) < 0.02  # the window forgot the slow one
    try:
        with timing.handling():
            raise ValueError
    except ValueError:
        pass
    assert timing.oldest_in_hand_s() == 0.0  # a failed handling is out of hand too
