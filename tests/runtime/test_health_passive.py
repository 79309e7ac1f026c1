"""The passive health checks read from ping replies: error rate over a window, a handling far outside the
kind's recent times. Pure functions of the replies: each rule's edges, and what must not trip them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import time
from collections.abc import Awaitable
from pathlib import Path

from runtime.actor import Actor, ActorContext, ActorIdentity, ActorSettings
from runtime.health import _passive
from runtime.run_config import HealthSection
from runtime.work_timing import WorkTiming
from tests.small_disk import FullDisk
from tests.waiting import until

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


async def test_a_handling_waiting_out_a_full_disk_is_not_held_against_it(tmp_path: Path) -> None:
    # limits of 0.5 s (outlier floor and stuck_s) stand for the 120 s that a full disk's 600 s wait outlasted
    cfg = HealthSection(error_window=0, outlier_factor=20.0, outlier_min_s=0.5, outlier_min_samples=1, stuck_s=0.5)
    store = FullDisk(tmp_path, [errno.ENOSPC] * 1_000_000, max_full_s=60.0)
    actor = Actor(ActorContext(ActorIdentity("k", "k-1", 1, "h", "c"), None, ActorSettings(), None, blob=store))
    with actor.work_timing.handling():  # one quick handling: the kind's history
        pass

    async def handling(work: Awaitable[object]) -> None:
        actor._inflight, actor._progress_at = 1, actor.work_timing.now()  # as `_consume` takes work up
        try:
            with actor.work_timing.handling():
                await work
        finally:
            actor._inflight, actor._progress_at = 0, actor.work_timing.now()

    writing = asyncio.ensure_future(handling(store.put("checkpoint", b"w")))
    await until(lambda: store.space.num_waiting == 1, 5, "the write to wait for space")
    await asyncio.sleep(1.0)
    assert _passive(actor.ping(), cfg, collections.deque()) is None, actor.ping()
    store.errnos.clear()  # space again: the write ends, and its wait is not in its time either
    await asyncio.wait_for(writing, 5)
    assert actor.work_timing.recent_quantile(0.99) < 0.5 and store.space_waited_s() >= 1.0

    # what is not a storage wait still counts: a handling hung as long is judged
    hung = asyncio.ensure_future(handling(asyncio.sleep(3600)))
    await asyncio.sleep(1.0)
    verdict = _passive(actor.ping(), cfg, collections.deque())
    hung.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await hung
    assert verdict is not None and verdict.check == "progress", actor.ping()
