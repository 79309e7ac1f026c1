"""Health checks find actors that are alive but useless, and the supervisor replaces them, losing nothing:
a process that answers nothing (SIGSTOP), one whose probe fails while it serves (its engine died), one
whose handler never returns (found by the absolute bound, and by being far outside the kind's recent
handling times), one that fails every handling it takes. Each is detected within the configured bound and
replaced by a new process; every message's effect happens exactly once."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from ops.tail import event_time
from tests.integration.harness import LiveRun, run_events, write_config
from tests.integration.test_actor_runtime import _collect, _effects, _publish
from tests.integration.test_e2e import _short_run, assert_every_prompt_accounted, starting_policy  # noqa: F401
from tests.waiting import until

pytestmark = pytest.mark.timeout(900)

AILING_RUN = """
[supervisor]
max_restarts = 10
backoff_base_s = 0.2

[health]
interval_s = 0.5
ping_timeout_s = 1.0
probe_every = 2
probe_timeout_s = 2.0
max_failures = 2
stuck_s = 4.0
start_grace_s = 60.0
error_window = 4
max_error_rate = 0.5
min_outcomes = 5
outlier_factor = 50.0
outlier_min_s = 2.0
outlier_min_samples = 10

[actors.ailing]
entry = "tests.integration.workers:AilingCounterActor"
count = 1
max_concurrency = 4
heartbeat_s = 1.0
max_deliveries = 40
"""
# detection bounds from the [health] section above: two failed checks of one kind in a row, pings and probes
# alternating (each tick at most interval + its timeout), plus 2 s of slack for a loaded machine
TICK_S = 0.5 + 2.0
BOUND_S = {"liveness": 4 * TICK_S + 2.0, "readiness": 5 * TICK_S + 2.0, "progress": 4.0 + 2 * TICK_S + 2.0,
           "errors": 6 * TICK_S + 2.0}


async def _unhealthy_and_replaced(run: LiveRun, check: str, fault_at: float, victim: str, reason: str,
                                  bound_s: float | None = None) -> dict:
    async def found_and_replaced() -> bool:  # the replacement is started (and said) just after the verdict
        return any(e["old_id"] == victim for e in run_events(run.run_dir, "actor_replaced"))

    await until(found_and_replaced, 60, f"the {check} fault found and the actor replaced")
    (event,) = [e for e in run_events(run.run_dir, "actor_unhealthy") if e["actor_id"] == victim]
    assert event["check"] == check and reason in event["reason"], event
    when = event_time(event)
    assert when is not None, event
    took, bound = when.timestamp() - fault_at, bound_s or BOUND_S[check]
    if check == "progress":  # an outlier's limit follows the kind's recent times: one slow handling raises it
        assert event["limit_s"] < 60, event  # either way far below the outlier test's stuck_s (600 s)
        bound = max(bound, event["limit_s"] + 2 * TICK_S + 2.0)
    assert took <= bound, f"{check} fault found after {took:.1f}s, bound {bound}s"
    (replaced,) = [e for e in run_events(run.run_dir, "actor_replaced") if e["old_id"] == victim]
    return replaced


async def _run_with_fault(tmp_path: Path, check: str, trigger: str | None, *settings: str,
                          reason: str = "") -> None:
    cfg = write_config(tmp_path / "run.toml", AILING_RUN)
    run = await LiveRun(tmp_path / "run", cfg, "--set", "bus.ack_wait_s=3.0", *settings).start()
    try:
        (victim,) = await run.wait_actors("ailing", 1)
        handled: list[dict] = []
        await _collect(run, "test.handled", handled)
        keys = [f"k{i}" for i in range(60)]
        await _publish(run, keys[:30], sleep_s=0.02)
        fault_at = time.time()
        if trigger is None:
            os.kill(victim["pid"], signal.SIGSTOP)  # alive, answering nothing
        else:
            await _publish(run, [trigger])
        await _publish(run, keys[30:40], sleep_s=0.02)  # work that reaches the ailing process
        replaced = await _unhealthy_and_replaced(run, check, fault_at, victim["id"], reason)
        await _publish(run, keys[40:], sleep_s=0.02)  # the run goes on, on the replacement
        wanted = set(keys) | ({trigger} if trigger else set())
        effects: dict[str, dict] = {}

        async def all_done() -> bool:
            effects.update(await _effects(run))
            return set(effects) >= wanted

        await until(all_done, 90, "every message's effect")
        created = Counter(h["key"] for h in handled if not h["duplicate"])
        assert all(created[k] <= 1 for k in wanted), "nothing happened twice"
        assert any(e["actor"] == replaced["new_id"] for e in effects.values()), "the replacement serves"
        assert victim["id"] not in {a["id"] for a in await run.actors()}, "the unhealthy process is gone"
    finally:
        assert await run.stop() == 0


async def test_a_process_that_answers_nothing_is_replaced(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "liveness", None)


async def test_an_actor_whose_probe_fails_while_it_serves_is_replaced(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "readiness", "ail-probe")


async def test_an_actor_whose_work_never_ends_is_replaced(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "progress", "ail-hang", "--set", "health.outlier_factor=0",
                          reason="without finishing any")


async def test_a_handling_far_outside_its_recent_times_is_found_before_the_absolute_bound(tmp_path: Path) -> None:
    # stuck_s far away: only the handling's distance from the kind's recent times can find it in the bound
    await _run_with_fault(tmp_path, "progress", "ail-hang", "--set", "health.stuck_s=600", reason="the p99")


async def test_an_actor_that_fails_everything_it_takes_is_replaced(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "errors", "ail-errors", reason="handlings failed")


async def test_a_warm_standby_takes_a_dead_actors_place_and_a_new_one_stands_by(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "run.toml", AILING_RUN + "standby = 1\n")
    run = await LiveRun(tmp_path / "run", cfg, "--set", "bus.ack_wait_s=3.0").start()
    try:
        (victim,) = await run.wait_actors("ailing", 1)
        (spare,) = await run.wait_actors_in("ailing", "standby", 1)
        keys = [f"k{i}" for i in range(40)]
        await _publish(run, keys[:20], sleep_s=0.02)
        os.kill(victim["pid"], signal.SIGKILL)

        async def promoted() -> bool:
            return any(e["actor_id"] == spare["id"] for e in run_events(run.run_dir, "standby_promoted"))

        await until(promoted, 30, "the standby promoted")
        await _publish(run, keys[20:], sleep_s=0.02)
        effects: dict[str, dict] = {}

        async def all_done() -> bool:
            effects.update(await _effects(run))
            return set(effects) >= set(keys)

        await until(all_done, 90, "every message's effect")
        assert any(e["actor"] == spare["id"] for e in effects.values()), "the promoted spare serves"
        (new_spare,) = await run.wait_actors_in("ailing", "standby", 1)
        assert new_spare["id"] not in (victim["id"], spare["id"]), "a new spare stands by behind it"
        assert not [e for e in run_events(run.run_dir, "actor_restarted")], "no cold restart was needed"
    finally:
        assert await run.stop() == 0


WEDGE_HEALTH = """
[health]
interval_s = 1.0
ping_timeout_s = 3.0
probe_every = 2
probe_timeout_s = 5.0
max_failures = 2
start_grace_s = 300.0

[actors.rollout]
entry = "tests.integration.faulty_rollout:WedgingRolloutActor"
drain_timeout_s = 10.0
"""
# two failed probes in a row, probes every other check: at most 4 checks of (interval + probe timeout), slack 10 s
WEDGE_BOUND_S = 4 * (1.0 + 5.0) + 10.0


@pytest.mark.slow
async def test_a_rollout_actor_whose_real_engine_wedges_is_replaced_and_the_run_loses_nothing(
        tmp_path: Path, starting_policy: Path) -> None:  # noqa: F811
    cfg = [*_short_run(tmp_path, seed=2, steps=3, checkpoint=starting_policy),
           write_config(tmp_path / "wedge.toml", WEDGE_HEALTH)]
    run = await LiveRun(tmp_path / "run", cfg, "--set", "bus.ack_wait_s=5.0",
                        "--set", "reconciler.scheduling.rollout_timeout_s=60.0").start()
    try:
        (victim,) = await run.wait_actors("rollout", 1, timeout_s=180)

        def injected() -> dict | None:
            return next(iter(run_events(run.run_dir, "test_fault_injected")), None)

        fault = await until(injected, 300, "the engine wedged after the first rollout")
        replaced = await _unhealthy_and_replaced(run, "readiness", _when(fault), victim["id"], "",
                                                 bound_s=WEDGE_BOUND_S)
        assert await run.wait_exit(600) == 0, run.output()
    finally:
        await run.stop()
    await assert_every_prompt_accounted(run.run_dir, steps=3)
    started = {e["actor"] for e in run_events(run.run_dir, "actor_running") if e.get("kind") == "rollout"}
    assert replaced["new_id"] in started, "the replacement served the rest of the run"


def _when(event: dict) -> float:
    when = event_time(event)
    assert when is not None, event
    return when.timestamp()
