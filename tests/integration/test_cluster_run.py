"""A run on a three-server JetStream cluster on loopback (``bus.embedded_servers = 3``): the real reconciler
and the simulated stages (tests/integration/sim_stages.py), every stream and bucket with three replicas;
and the chaos of a server killed mid-run (the leader of the slot table's stream), restarted by the
runtime: the run carries on, every prompt trained once or accounted with a reason, no group trained
twice, and training stalls no longer than the JetStream leader election it waits for.

The commands the README gives for trying it by hand::

    python -m actors --set bus.embedded_servers=3            # replicas 3 by default on a cluster
    python -m runtime.up --config RUN.toml --set 'bus.url=["nats://a:4222", "nats://b:4222", "nats://c:4222"]'
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from actors.reconciler.slot import SlotState
from actors.reconciler.store import CURSOR_KEY
from runtime.bus import Bus
from runtime.events import parse_event
from runtime.natsserver import SERVER_LOG
from tests.integration.harness import LiveRun, descendants, run_events, write_config
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
from tests.integration.test_bus_outage import _despite_outages
from tests.integration.test_reconciler import _account, _durable_table, _num_trained_groups, _trained
from tests.waiting import until

pytestmark = pytest.mark.timeout(420)

NUM_PROMPTS, GROUP_SIZE, ETA = 96, 4, 2
STREAMS = ("LOG", "DLQ", "KV_slots", "KV_config", "KV_actors", "Q_WORK_ROLLOUT", "Q_DONE")
_LOG_TIME = re.compile(r"^\[\d+\] (\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) ")
_ELECTED = ("new stream leader", "new consumer leader", "new metadata leader")


def _sim_run(tmp_path: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.1, sigma=0.5, max_s=0.5), reward=StageSim(median_s=0.02, max_s=0.2),
              group=StageSim(median_s=0.02, max_s=0.2), train=StageSim(median_s=0.1, max_s=0.3), seed=5).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=NUM_PROMPTS, num_slots=48, group_size=GROUP_SIZE, batch_groups=4, eta=ETA,
        rollout_count=2, reward_count=1, stage_timeout_s=20.0))
    return run_dir, cfg


def _finished(bus: Bus) -> Any:
    async def finished() -> bool:
        if await bus.kv_get("slots", CURSOR_KEY) is None:  # the reconciler has not written its table yet
            return False
        cursor, slots, _ = await _durable_table(bus)
        return cursor.position == NUM_PROMPTS and all(s.state is SlotState.EMPTY for s in slots)

    return finished


def _server_pids(run: LiveRun) -> dict[str, int]:
    """server name (n0, n1, n2) -> pid of the cluster's nats-servers under runtime.up."""
    assert run.proc is not None
    pids = {}
    for pid in descendants(run.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "nats-server" in cmdline and (m := re.search(r"/nats/(n\d)/nats-server\.conf", cmdline)):
            pids[m.group(1)] = pid
    return pids


async def _leader(bus: Bus, stream: str) -> str:
    info = await bus.js.stream_info(stream)
    assert info.cluster is not None and info.cluster.leader, f"{stream}: no leader"
    return info.cluster.leader


def _elections_after(run_dir: Path, since: float) -> list[float]:
    """Wall times of the leader elections the cluster's servers logged after ``since``."""
    times = []
    for log_file in (run_dir / "nats").glob(f"n*/{SERVER_LOG}"):
        for line in log_file.read_text(errors="replace").splitlines():
            if any(e in line for e in _ELECTED) and (m := _LOG_TIME.match(line)):
                at = datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                if at >= since:
                    times.append(at)
    return times


def _said_during(run_dir: Path, start: float, end: float) -> list[str]:
    """What the run's processes said at warning or above between two wall times: why a stall lasted."""
    said = []
    for f in sorted((run_dir / "logs").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            e = parse_event(line)
            at = datetime.fromisoformat(e["time"]).timestamp() if e and "time" in e else None
            if at is not None and start <= at <= end and e.get("level") in ("warning", "error", "critical"):
                fields = {k: v for k, v in e.items() if k not in ("event", "time", "level")}
                said.append((at - start, f"{at - start:.2f}s {f.stem} {e['event']} {fields}"[:300]))
    return [line for _, line in sorted(said)]


def _longest_gap_around(batch_times: list[float], at: float) -> float:
    """The longest time without a trained batch over the interval that holds ``at``."""
    before = max((t for t in batch_times if t <= at), default=at)
    after = min((t for t in batch_times if t > at), default=float("inf"))
    return after - before


async def test_a_short_run_on_a_three_server_cluster_trains_every_prompt_once(tmp_path: Path) -> None:
    run_dir, cfg = _sim_run(tmp_path)
    run = await LiveRun(run_dir, cfg, "--set", "bus.embedded_servers=3").start()
    try:
        assert run.bus is not None and run.info is not None
        assert len(run.info.nats_url.split(",")) == 3, run.info.nats_url
        ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))

        await until(_finished(run.bus), 240, "every prompt trained on the cluster", every_s=1.0)
        for stream in STREAMS:
            info = await run.bus.js.stream_info(stream)
            assert info.config.num_replicas == 3 and info.cluster and len(info.cluster.replicas or []) == 2, stream
        await _account(run.bus, ledger, NUM_PROMPTS, GROUP_SIZE, ETA)
    finally:
        assert await run.stop() == 0


@pytest.mark.slow
async def test_a_cluster_server_killed_mid_run_stalls_training_no_longer_than_the_leader_election(
        tmp_path: Path) -> None:
    run_dir, cfg = _sim_run(tmp_path)
    run = await LiveRun(run_dir, cfg, "--set", "bus.embedded_servers=3").start()
    kills: list[tuple[str, float]] = []
    try:
        assert run.bus is not None
        ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))
        for fraction, stream in ((0.25, "KV_slots"), (0.55, "Q_WORK_ROLLOUT")):
            async def progressed(fraction: float = fraction) -> bool:
                return await _num_trained_groups(ledger) >= fraction * NUM_PROMPTS

            await until(_despite_outages(progressed), 180, f"{fraction:.0%} of the prompts trained", every_s=0.5)
            leader = await _leader(run.bus, stream)
            os.kill(_server_pids(run)[leader], signal.SIGKILL)  # the leader of the stream: an election
            kills.append((leader, time.time()))

        await until(_despite_outages(_finished(run.bus)), 240, "every prompt trained after two server kills",
                     every_s=1.0)
        await _account(run.bus, ledger, NUM_PROMPTS, GROUP_SIZE, ETA)
        batches = (await _trained(ledger))["trained"].values()
    finally:
        rc = await run.stop()
    assert rc == 0, run.output()
    batch_times = sorted(b["time"] for b in batches)
    gaps = sorted(b - a for a, b in itertools.pairwise(batch_times))
    restarts = run_events(run_dir, "nats_server_restarted")
    assert len(restarts) == 2, restarts
    # servers died, no actor: an election that stores no lease renewal for seconds loses no one
    assert run_events(run_dir, "actor_lost") == [], run_events(run_dir, "actor_lost")
    for (leader, at), until_s in zip(kills, [b - a for (_, a), (_, b) in itertools.pairwise(kills)] + [30.0],
                                     strict=True):
        elections = [t - at for t in _elections_after(run_dir, at)]
        election_s = max((t for t in elections if t < until_s), default=0.0)  # the ones this kill caused
        stall_s = _longest_gap_around(batch_times, at)
        print(f"killed {leader} (leader): training stalled {stall_s:.2f}s; the last leader election it caused "
              f"ended {election_s:.2f}s after the kill; median gap between batches {gaps[len(gaps) // 2]:.2f}s")
        assert election_s > 0, "the servers logged no leader election after the kill"
        # the stall is the election plus the clients' reconnection and the stages' next round trip
        assert stall_s <= election_s + 5.0, (stall_s, election_s, _said_during(run_dir, at, at + stall_s))
    # the clients of the killed servers (which clients those were is the draw of nats-py's shuffled server
    # list: on a loaded machine a kill can find none) each reconnected, to a member it names
    lost = {e["client"] for e in run_events(run_dir, "bus_disconnected")}
    moved = {e["client"] for e in run_events(run_dir, "bus_reconnected") if e.get("server")}
    assert lost <= moved, f"clients that lost their server and never reconnected: {lost - moved}"
    print(f"{len(lost)} clients lost their server and reconnected to another member")
    crashes = [c for c in run_events(run_dir, "actor_crashed") if "error" in c]  # the processes' own words
    assert not crashes, f"an actor did not ride out the election: {[(c['kind'], c['error'][-300:]) for c in crashes]}"
    unavailable = run_events(run_dir, "consumer_unavailable")
    print(f"{len(unavailable)} times a consumer had no leader for a while: {[e['consumer'] for e in unavailable]}")
