"""The watchdog: a run in which nothing advances for supervisor.stall_s says so, naming the stage."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import msgpack
import pytest

from runtime.bus import work_queue
from runtime.codec import Codec
from runtime.watchdog import Stall, Watchdog
from tests.integration.harness import LiveRun, nats_bus, write_config
from tests.integration.workers import CountRequest

pytestmark = pytest.mark.timeout(120)


async def _first_stall(watchdog: Watchdog, timeout_s: float) -> Stall:
    stalls: asyncio.Queue[Stall] = asyncio.Queue()
    watchdog.on_stall = stalls.put_nowait
    task = asyncio.ensure_future(watchdog.run())
    try:
        return await asyncio.wait_for(stalls.get(), timeout_s)
    finally:
        task.cancel()


async def test_a_queue_whose_messages_never_finish_is_named(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        for stage in ("slow", "idle"):
            await bus.ensure_queue(work_queue(stage))
        for i in range(3):
            await bus.publish_durable("work.slow", b"x", msg_id=f"m{i}")
        out = io.StringIO()
        stall = await _first_stall(Watchdog(bus, stall_s=1.0, terminal=out), 10)
        assert stall.holder is not None and stall.holder.subject == "work.slow"
        assert stall.holder.num_outstanding == 3 and stall.stalled_s >= 1.0
        assert "run stalled: nothing advanced for" in out.getvalue() and "held by work.slow" in out.getvalue()


async def test_no_work_anywhere_says_that_nothing_issues_any(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        await bus.ensure_queue(work_queue("idle"))
        stall = await _first_stall(Watchdog(bus, stall_s=1.0, terminal=io.StringIO()), 10)
        assert stall.holder is None and "nothing issues any" in stall.describe()


async def test_acknowledgements_and_progress_reports_keep_it_quiet(tmp_path: Path) -> None:
    async with nats_bus(tmp_path) as bus:
        queue = work_queue("busy")
        await bus.ensure_queue(queue)
        sub = await bus.js.pull_subscribe_bind(durable=queue.durable, stream=queue.stream)

        async def work() -> None:  # one message finished every 0.3 s
            for i in range(100):
                await bus.publish_durable("work.busy", b"x", msg_id=f"b{i}")
                for m in await sub.fetch(1, timeout=5):
                    await m.ack()
                await asyncio.sleep(0.3)

        async def report() -> None:  # nothing acknowledged, but a stage says it is working
            while True:
                await bus.nc.publish("progress.eval", msgpack.packb({"done": 1}))
                await asyncio.sleep(0.3)

        for keep_busy in (work, report):
            busy = asyncio.ensure_future(keep_busy())
            try:
                with pytest.raises(TimeoutError):
                    await _first_stall(Watchdog(bus, stall_s=1.0, terminal=io.StringIO()), 4)
            finally:
                busy.cancel()


async def test_a_wedged_stage_is_named_on_the_terminal_of_a_live_run(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "run.toml", """
[supervisor]
stall_s = 2.0
[actors.counter]
entry = "tests.integration.workers:CounterActor"
max_concurrency = 2
heartbeat_s = 0.5
""")
    run = await LiveRun(tmp_path / "run", cfg).start()
    try:
        await run.wait_actors("counter", 1)
        assert run.bus is not None
        codec = Codec([CountRequest])
        for key in ("a", "b", "c"):  # two handled for 12 s (heartbeats keep them), one waiting
            await run.bus.publish_durable("work.count", await codec.encode(CountRequest(key, 12.0)), msg_id=key)
        log_file = run.run_dir / "logs" / "supervisor.jsonl"

        async def stalled() -> dict:  # an earlier one may say "no stage has work": the actor was starting
            while True:
                events = [json.loads(line) for line in log_file.read_text().splitlines()]
                if found := [e for e in events if e.get("event") == "run_stalled" and e.get("stage")]:
                    return found[0]
                await asyncio.sleep(0.2)

        first = await asyncio.wait_for(stalled(), 30)
        assert first["stage"] == "work.count" and first["num_outstanding"] == 3, first
    finally:
        assert await run.stop() == 0
    output = run.output()
    assert "run stalled: nothing advanced for" in output and "held by work.count: 3 messages" in output, output
