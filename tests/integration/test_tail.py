"""``python -m ops.tail`` on a real run: live latency, filters, replay from a time, offline fallback.

Events are triggered through the run's real paths: a live configuration change makes every counter
actor log ``config_changed`` (info); a malformed work message makes it log ``message_dead_lettered``
(error).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgpack
import pytest

from ops.tail import STOP_GRACE_S
from tests.integration.harness import REPO, LiveRun, write_config

COUNTER_RUN = """
[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = 2
heartbeat_s = 1.0
"""

pytestmark = pytest.mark.timeout(180)
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}  # SIGABRT: the stacks on stderr
EXIT_BOUND_S = STOP_GRACE_S + 5.0  # Ctrl-C: the tail stops itself within its grace; 5 s for the process to end


@pytest.fixture
async def run(tmp_path: Path):
    live = await LiveRun(tmp_path / "run", write_config(tmp_path / "run.toml", COUNTER_RUN)).start()
    try:
        await live.wait_actors("counter", 2)
        yield live
    finally:
        assert await live.stop() == 0


async def set_delay_scale(run: LiveRun, value: float) -> None:
    assert run.bus is not None
    kv = await run.bus.kv("config")
    await kv.put("counter.delay_scale", msgpack.packb(value, use_bin_type=True))


async def dead_letter(run: LiveRun) -> None:
    assert run.bus is not None
    await run.bus.js.publish("work.count", b"\xc1not msgpack")


def tail_sync(run: LiveRun, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ops.tail", str(run.run_dir), *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def tail_events(run: LiveRun, *args: str) -> list[dict]:
    done = await asyncio.to_thread(tail_sync, run, "--json", "--no-follow", *args)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


async def replay_until(run: LiveRun, n: int, *args: str) -> list[dict]:
    """Replays everything matching until n events are there (actors log on their own schedule)."""
    async with asyncio.timeout(20):
        while len(events := await tail_events(run, "--from-start", *args)) < n:  # noqa: ASYNC110 - no signal
            await asyncio.sleep(0.2)
    return events


def own_time(event: dict) -> datetime:
    return datetime.fromisoformat(event["time"])


class LiveTail:
    """``python -m ops.tail --json`` following the run, read line by line with arrival times."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, run: LiveRun, *args: str) -> LiveTail:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ops.tail",
            str(run.run_dir),
            "--json",
            *args,
            cwd=REPO,
            env=ENV,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def next_event(self, timeout_s: float) -> tuple[dict, datetime]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        arrived = datetime.now(UTC)
        assert line, f"ops.tail exited: {(await self.proc.stderr.read()).decode()}"  # type: ignore[union-attr]
        return json.loads(line), arrived

    async def wait_for(self, predicate, timeout_s: float) -> tuple[dict, datetime]:
        async with asyncio.timeout(timeout_s):
            while True:
                event, arrived = await self.next_event(timeout_s)
                if predicate(event):
                    return event, arrived

    async def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = await asyncio.wait_for(self.proc.communicate(), EXIT_BOUND_S)
        except TimeoutError:  # say where it is stuck: faulthandler prints every thread's stack on SIGABRT
            self.proc.send_signal(signal.SIGABRT)
            _, err = await asyncio.wait_for(self.proc.communicate(), 10)
            raise AssertionError(f"ops.tail did not exit within {EXIT_BOUND_S}s of SIGINT; its stderr:\n"
                                 f"{err.decode()[-6000:]}") from None
        return self.proc.returncode or 0, err.decode()


async def test_live_events_reach_the_tail_within_a_second(run: LiveRun) -> None:
    tail = await LiveTail.start(run)
    try:
        # The tail delivers new events only: nudge until it shows one, so it is surely subscribed.
        async def ready() -> None:
            for i in range(100):
                await set_delay_scale(run, 2.0 + i)
                try:
                    await tail.wait_for(lambda e: e["event"] == "config_changed", 0.5)
                    return
                except TimeoutError:
                    continue

        await asyncio.wait_for(ready(), 30)
        latencies = []
        for value in (0.25, 0.5, 0.75):
            await asyncio.sleep(0.2)  # let the nudges drain, so each wait sees its own change
            await set_delay_scale(run, value)
            event, arrived = await tail.wait_for(lambda e, v=value: e["event"] == "config_changed" and e["new"] == v, 5)
            assert event["kind"] == "counter" and event["level"] == "info"
            latencies.append((arrived - own_time(event)).total_seconds())
        print(f"ops.tail arrival minus event time, s: {latencies}")  # shown with pytest -s
        assert max(latencies) < 1.0, latencies
        assert min(latencies) > -0.05, f"the tail cannot see an event before it happens: {latencies}"
    finally:
        rc, err = await tail.interrupt()
    assert rc == 130 and "Traceback" not in err, err


async def test_filters_on_a_live_run(run: LiveRun) -> None:
    await dead_letter(run)
    await set_delay_scale(run, 0.5)
    await dead_letter(run)

    await replay_until(run, 2 + 2, "--event", "config_changed", "--event", "message_*")  # 2 actors, 2 letters

    errors = await tail_events(run, "--from-start", "--actor", "counter", "--level", "error")
    assert [e["event"] for e in errors] == ["message_dead_lettered"] * 2
    assert all(e["reason"] == "malformed" and e["kind"] == "counter" for e in errors)

    one = errors[0]["actor"]  # an actor id, not a kind
    by_id = await tail_events(run, "--from-start", "--actor", one, "--event", "message_dead_lettered")
    assert by_id and {e["actor"] for e in by_id} == {one}

    changed = await tail_events(run, "--from-start", "--event", "config_*", "--where", "new=0.5")
    assert len(changed) == 2 and {e["key"] for e in changed} == {"counter.delay_scale"}
    assert await tail_events(run, "--from-start", "--event", "config_*", "--where", "new=0.6") == []

    supervisor = await tail_events(run, "--from-start", "--actor", "supervisor", "--event", "actor_spawned")
    assert len(supervisor) == 2 and {e["actor"] for e in supervisor} == {"supervisor"}

    grepped = await tail_events(run, "--from-start", "--grep", r'"reason": "malform')
    assert [e["event"] for e in grepped] == ["message_dead_lettered"] * 2

    readable = await asyncio.to_thread(
        tail_sync, run, "--from-start", "--no-follow", "--level", "error", "--color", "always"
    )
    assert readable.returncode == 0 and "\x1b[31m" in readable.stdout and "message_dead_lettered" in readable.stdout


async def test_replay_from_a_past_time(run: LiveRun) -> None:
    await set_delay_scale(run, 0.3)
    await asyncio.sleep(1.0)
    await set_delay_scale(run, 0.4)

    events = await replay_until(run, 4, "--event", "config_changed")  # two changes, two actors each
    earlier = max(own_time(e) for e in events if e["new"] == 0.3)
    later = min(own_time(e) for e in events if e["new"] == 0.4)
    assert later - earlier > timedelta(seconds=0.5)
    between = earlier + (later - earlier) / 2

    replayed = await tail_events(run, "--since", between.isoformat(), "--event", "config_changed")
    assert sorted(e["new"] for e in replayed) == [0.4, 0.4], "the later change, not the earlier one"
    relative = await tail_events(run, "--since", "10m", "--event", "config_changed")
    assert sorted(e["new"] for e in relative) == [0.3, 0.3, 0.4, 0.4]

    # A follower ends with the run, by itself: the events sent before the end (the supervisor's), then the outcome.
    follower = await LiveTail.start(run, "--from-start")
    await follower.next_event(30)  # replayed: it is on the bus, following
    assert await run.stop() == 0
    out, err = await asyncio.wait_for(follower.proc.communicate(), 30)
    assert follower.proc.returncode == 0, err.decode()
    assert err.decode().endswith(f"ops.tail: run {run.run_dir} stopped\n"), err.decode()
    assert "supervisor_stopped" in [json.loads(line)["event"] for line in out.decode().splitlines()]

    # The same replay from the files once the run is down: the tail says so and falls back.
    offline = await asyncio.to_thread(
        tail_sync, run, "--json", "--since", between.isoformat(), "--event", "config_changed"
    )
    assert offline.returncode == 0 and "not reachable" in offline.stderr
    assert sorted(json.loads(x)["new"] for x in offline.stdout.splitlines()) == [0.4, 0.4]
