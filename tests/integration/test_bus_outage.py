"""Losing the bus server, on real runs: the embedded nats-server killed mid-run is restarted on its
port and JetStream store and the run carries on by itself (the real reconciler with the simulated
stages); a bus lost for longer than ``bus.max_outage_s``, or a server past its restart limit, fails
the run with a clear reason; and stopping is clean while the bus is down (no traceback, every actor
exits 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from actors.reconciler.slot import SlotState
from runtime.bus import Bus
from runtime.events import parse_event
from runtime.natsserver import NatsServer, NatsServerConfig
from tests.integration.harness import LiveRun, descendants, write_config
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
from tests.integration.test_reconciler import _durable_table, _num_trained_groups, _trained
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)

COUNTER_RUN = """
[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = 2
heartbeat_s = 1.0
"""


def _despite_outages(predicate: Any) -> Any:
    """The test's own client rides out the outages too: a query that fails while the bus is down is
    a 'not yet'."""
    async def check() -> bool:
        try:
            return await predicate()
        except (nats.errors.Error, OSError):
            return False

    return check


def _server_pid(run: LiveRun) -> int:
    assert run.proc is not None
    for pid in descendants(run.proc.pid):
        try:
            if b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError("no nats-server under runtime.up")


def _events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    events = []
    for path in (run_dir / "logs").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            event = parse_event(line)  # a process killed mid-write leaves a torn last line
            if event is not None and event.get("event") == name:
                events.append(event)
    return events


def _assert_clean_exit(run_dir: Path, output: str, crashed: frozenset[str] = frozenset()) -> None:
    """No traceback anywhere; every actor process exited 0 when the run stopped; no crash but ``crashed``."""
    assert "Traceback" not in output, output
    for out in (run_dir / "logs").glob("*.out"):
        if out.stem not in crashed:
            assert "Traceback" not in out.read_text(), f"{out.name}:\n{out.read_text()[-3000:]}"
    exits = _events(run_dir, "actor_exited")
    assert exits and all(e["returncode"] == 0 for e in exits), exits
    assert {e["actor_id"] for e in _events(run_dir, "actor_crashed") if "actor_id" in e} <= crashed


async def _wait_exit(run: LiveRun, timeout_s: float) -> tuple[int, str]:
    assert run.proc is not None
    try:
        rc = await asyncio.to_thread(run.proc.wait, timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"runtime.up still running {timeout_s}s later") from None
    return rc, run.output()


@pytest.mark.slow
async def test_the_bus_server_killed_mid_run_is_restarted_and_the_run_carries_on(tmp_path: Path) -> None:
    num_prompts, group_size = 96, 4
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.05, sigma=0.5, max_s=0.5), reward=StageSim(median_s=0.02, max_s=0.2),
              group=StageSim(median_s=0.02, max_s=0.2), train=StageSim(median_s=0.05, max_s=0.3), seed=3).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=num_prompts, num_slots=48, group_size=group_size, batch_groups=4, eta=2,
        rollout_count=1, reward_count=1, stage_timeout_s=20.0))
    run = await LiveRun(run_dir, cfg).start()
    try:
        assert run.bus is not None
        ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))
        killed = []
        for fraction in (0.2, 0.5):
            async def progressed(fraction: float = fraction) -> bool:
                return await _num_trained_groups(ledger) >= fraction * num_prompts

            await until(_despite_outages(progressed), 120, f"{fraction:.0%} of the prompts trained", every_s=0.5)
            pid = _server_pid(run)
            os.kill(pid, signal.SIGKILL)  # mid-run: work in every stream, watches and pulls open
            killed.append((pid, time.monotonic()))

        async def finished() -> bool:
            cursor, slots, _ = await _durable_table(run.bus)
            return cursor.position == num_prompts and all(s.state is SlotState.EMPTY for s in slots)

        await until(_despite_outages(finished), 180, "every prompt trained after two server kills", every_s=1.0)
        batches = list((await _trained(ledger))["trained"].values())
        groups = [g for b in batches for g in b["group_ids"]]
        assert len(groups) == len(set(groups)), "a group was trained twice"
        assert len(groups) >= 0.9 * num_prompts, f"only {len(groups)} of {num_prompts} prompts trained"
        restarts = _events(run_dir, "nats_server_restarted")
        assert len(restarts) == 2, restarts
        assert _server_pid(run) not in {pid for pid, _ in killed}
        # Every stage actor rides out the outages. The reconciler may not: a kill -9 loses the server's
        # last unflushed writes, and the reconciler's pipelined slot writes (chained on the stream's last
        # sequence) then find the chain broken; it stops and its successor resumes from the store.
        crashes = [c for c in _events(run_dir, "actor_crashed") if "error" in c]  # the processes' own words
        assert all(c["kind"] == "reconciler" and ("CasConflict" in c["error"] or "StoreBroken" in c["error"])
                   for c in crashes), crashes
        crashed = frozenset(c["actor"] for c in crashes)
        assert len(_events(run_dir, "kv_watch_renewed")) >= 2, "the watches were renewed after the restarts"
    finally:
        rc = await run.stop()
    assert rc == 0
    _assert_clean_exit(run_dir, run.output(), crashed)


async def test_a_remote_bus_lost_past_its_bound_fails_the_run_cleanly(tmp_path: Path) -> None:
    server = NatsServer(NatsServerConfig(store_dir=tmp_path / "remote"))
    url = await server.start()
    run_dir = tmp_path / "run"
    run = await LiveRun(run_dir, write_config(tmp_path / "run.toml", COUNTER_RUN),
                        "--set", f'bus.url="{url}"', "--set", "bus.max_outage_s=3").start()
    try:
        await run.wait_actors("counter", 2)
        await run.bus.close()  # type: ignore[union-attr]
        run.bus = None
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)  # nobody restarts a remote bus
        lost_at = time.monotonic()
        rc, output = await _wait_exit(run, 90)
        took_s = time.monotonic() - lost_at
    finally:
        await run.stop()
        await server.stop()
    assert rc == 1, output
    assert "unreachable for more than 3s (bus.max_outage_s)" in output, output
    assert 3.0 <= took_s < 60, took_s
    print(f"the run failed {took_s:.1f}s after its remote bus was lost (bound 3 s, then the drain)")
    (lost,) = _events(run_dir, "bus_lost")
    assert url in lost["url"]
    _assert_clean_exit(run_dir, output)


async def test_stopping_while_the_bus_is_down_is_clean(tmp_path: Path) -> None:
    """Ctrl-C during an outage (the bus not back yet, the bound not reached): drained, exit 0."""
    server = NatsServer(NatsServerConfig(store_dir=tmp_path / "remote"))
    url = await server.start()
    run_dir = tmp_path / "run"
    run = await LiveRun(run_dir, write_config(tmp_path / "run.toml", COUNTER_RUN),
                        "--set", f'bus.url="{url}"', "--set", "bus.max_outage_s=120").start()
    try:
        await run.wait_actors("counter", 2)
        await run.bus.close()  # type: ignore[union-attr]
        run.bus = None
        assert server.pid is not None and run.proc is not None
        os.kill(server.pid, signal.SIGKILL)
        await asyncio.sleep(1.0)
        run.proc.send_signal(signal.SIGINT)
        rc, output = await _wait_exit(run, 90)
    finally:
        await run.stop()
        await server.stop()
    assert rc == 0, output
    _assert_clean_exit(run_dir, output)
    assert _events(run_dir, "stop_step_skipped"), "the actors said which bus steps they skipped"


async def test_an_embedded_server_past_its_restart_limit_fails_the_run_cleanly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = await LiveRun(run_dir, write_config(tmp_path / "run.toml", COUNTER_RUN),
                        "--set", "bus.server_max_restarts=0").start()
    try:
        await run.wait_actors("counter", 2)
        await run.bus.close()  # type: ignore[union-attr]
        run.bus = None
        os.kill(_server_pid(run), signal.SIGKILL)
        rc, output = await _wait_exit(run, 90)
    finally:
        await run.stop()
    assert rc == 1, output
    assert "died 1 times within 60s (limit 0 restarts)" in output, output
    _assert_clean_exit(run_dir, output)


async def test_an_actor_dying_during_an_outage_is_restarted_when_the_bus_is_back(tmp_path: Path) -> None:
    """With max_restarts = 0 any counted crash fails the run: one during an outage is not counted
    (no restart could connect, and it is the bus's fault); it is restarted once the bus is back."""
    server = NatsServer(NatsServerConfig(store_dir=tmp_path / "remote"))
    url = await server.start()
    run_dir = tmp_path / "run"
    run = await LiveRun(run_dir, write_config(tmp_path / "run.toml", COUNTER_RUN),
                        "--set", f'bus.url="{url}"', "--set", "supervisor.max_restarts=0").start()
    try:
        victim, _ = await run.wait_actors("counter", 2)
        await run.bus.close()  # type: ignore[union-attr]
        run.bus = None
        assert server.pid is not None and server.port is not None
        os.kill(server.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        await asyncio.sleep(2.0)
        await server.stop()
        server = NatsServer(NatsServerConfig(store_dir=tmp_path / "remote", port=server.port))
        await server.start()  # the same bus comes back
        run.bus = await Bus.connect(url, name="test")
        await run.wait_actors("counter", 2, timeout_s=60)

        async def replaced() -> bool:
            live = {a["id"] for a in await run.actors() if a["kind"] == "counter"}
            registered = {a["id"] for a in await run.wait_actors("counter", 2)}
            return len(live) == 2 and victim["id"] not in live | registered and live == registered

        await until(_despite_outages(replaced), 60, "the victim replaced and its registry entry dropped", every_s=0.5)
        assert run.proc is not None and run.proc.poll() is None, run.output()
    finally:
        rc = await run.stop()
        await server.stop()
    assert rc == 0
    (crash,) = _events(run_dir, "actor_crashed_during_bus_outage")
    assert crash["actor_id"] == victim["id"]
    assert not _events(run_dir, "restart_intensity_exceeded")


async def test_ops_tail_follows_across_a_server_restart(tmp_path: Path) -> None:
    """ops.tail --follow reads the LOG stream (`Bus.follow`: direct gets, then what LOG republishes), renewed
    on reconnect from the next sequence, so events after the restart arrive within seconds (an ordered
    consumer would be reset by nats-py itself only after missing heartbeats, ~20 s)."""
    from tests.integration.test_tail import LiveTail

    run_dir = tmp_path / "run"
    run = await LiveRun(run_dir, write_config(tmp_path / "run.toml", COUNTER_RUN)).start()
    tail = await LiveTail.start(run)
    try:
        assert run.bus is not None

        async def say(mark: str) -> None:
            line = json.dumps({"event": "probe", "mark": mark, "level": "info", "kind": "test",
                               "time": "2026-01-01T00:00:00+00:00"})
            await run.bus.nc.publish("log.test.info", line.encode())  # type: ignore[union-attr]

        async def shown(mark: str, within_s: float) -> None:
            async def nudge() -> None:  # until the tail shows it (it delivers new events only)
                while True:
                    await say(mark)
                    await asyncio.sleep(0.5)

            nudger = asyncio.ensure_future(nudge())
            try:
                await tail.wait_for(lambda e: e.get("mark") == mark, within_s)
            finally:
                nudger.cancel()

        await shown("before", 45)
        os.kill(_server_pid(run), signal.SIGKILL)
        async with asyncio.timeout(30):
            await run.bus.health.down.wait()
            await run.bus.health.up.wait()
        await shown("after", 10)  # nats-py's own reset of an ordered consumer took ~20 s
    finally:
        await tail.interrupt()
        assert await run.stop() == 0
