"""Benchmark: the reconciler's table and registry at scale, on a three-server JetStream cluster.

    .venv/bin/python -m tests.bench.scale [--slots 100,1000,100000] [--actors 10,100,1000]

Slots: for each table size S, the real lifecycle core (`actors.reconciler.Lifecycle`) on the reconciler's
own store (`PipelinedKVSlotStore`: every transition a compare-and-set in a bucket replicated on three
servers, writes group-committed as the reconciler does, one `sync` per ``--sync-every`` events) moves
samples through no-op stages completed in this process (FIFO, as tests/bench/lifecycle_core.py), with
the staleness bound sized so that the whole table is in flight: B = S / ((eta + 1) * G) groups per batch.
Reported per size: lifecycles/s and CPU per lifecycle (this process, the reconciler's side, and the three
nats-servers from /proc) over the steady span (after the first trained batch, until three tables' worth of
samples trained); the table's memory per slot (tracemalloc over a resume); the bucket's bytes; the
resume from the store with the table full (a new store and core, until its writes are durable).

Actors: for each count A, a child process keeps A simulated actors (many per connection, asyncio) each
with a real lease in the ``actors`` bucket (renewed every third of ``--lease-s`` with the TTL, as
`runtime.actor` does) and answering ``ctl.<kind>.<id>.metrics``. This process follows the registry as
the reconciler does (`RegistryView` fed by `Bus.kv_watch`, the running count read on every event,
leases expired every second) and reports the renewal traffic, its CPU per renewal, actors wrongly taken
for lost (bound: none), and one Prometheus scrape of all of them (`ops.dashboard.prometheus.scrape`:
its wall time, bound ``SCRAPE_BOUND_S``, and every actor up).

Prints ONE JSON line; ``cpu_per_lifecycle_ratio_1e5_over_1e3`` and ``resume_s_at_1e5`` when those sizes ran.
Memory: this process peaked at 635 MB at S = 10^5 (the table, its orders in flight, a resume's reads), the
servers' own beside it. Duration: about 10 to 15 minutes at the defaults on 2 cores, most of it at 10^5 slots.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import math
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import structlog

from actors import (
    Lifecycle,
    LifecycleConfig,
    ListTaskSource,
    SchedulingConfig,
    TrainOrder,
)
from actors.reconciler.kv_store import PipelinedKVSlotStore
from actors.reconciler.registry_view import RegistryView
from ops.dashboard import prometheus
from runtime.bus import Bus, BusLimits
from runtime.bus_auth import control_subject
from runtime.natsserver import NatsCluster, NatsServerConfig
from runtime.registry import parse_registration_key, registration_key
from tests.bench.lifecycle import cpu_s
from tests.bench.lifecycle_core import completion_for

REPO = Path(__file__).resolve().parents[2]
SCRAPE_BOUND_S = 5.0  # one scrape of every actor, Prometheus' default scrape timeout being 10 s
ACTORS_PER_CONNECTION = 100
METRICS_TEXT = (
    "# HELP asyncrl_actor_messages_handled messages handled\n"
    "# TYPE asyncrl_actor_messages_handled counter\n"
    "asyncrl_actor_messages_handled_total {n}\n"
    "# HELP asyncrl_actor_inflight messages in hand\n"
    "# TYPE asyncrl_actor_inflight gauge\n"
    "asyncrl_actor_inflight 1.0\n"
)


def _ints(value: str) -> list[int]:
    return [int(float(v)) for v in value.split(",") if v]


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def self_cpu_s() -> float:
    return time.process_time()


# --- slots ------------------------------------------------------------------------------------------------
async def slots_trial(bus: Bus, servers: list[int], num_slots: int, args: argparse.Namespace) -> dict[str, Any]:
    g, eta = args.group_size, args.eta
    b = max(1, num_slots // ((eta + 1) * g))
    bucket = f"slots_s{num_slots}"
    config = LifecycleConfig(
        num_slots=num_slots, group_size=g, batch_size_groups=b,
        scheduling=SchedulingConfig(eta=eta, max_inflight_per_rollout_actor=min(num_slots, 100_000)),
        transition_events_per_s=0,
    )
    target = args.tables * num_slots  # trained samples measured: this many tables' worth
    source = ListTaskSource.numbered(math.ceil((target + 2 * num_slots) / g))
    store = await PipelinedKVSlotStore.open(bus, bucket, args.ack_timeout_s)
    resumed = await Lifecycle.resume(store, source, config, time.time(), num_rollout_actors=1)
    await store.sync()
    core = resumed.lifecycle
    pending = collections.deque(resumed.orders)
    version = 0
    trained = 0
    start: tuple[float, float, float, int] | None = None  # wall, own CPU, servers' CPU, trained
    next_tick = time.monotonic() + 1.0
    while pending and trained < target + (start[3] if start else 0):
        for _ in range(min(args.sync_every, len(pending))):
            order = pending.popleft()
            if isinstance(order, TrainOrder):
                version = order.trainer_version + 1
            pending.extend(await core.on_completion(completion_for(order, version), time.time()))
        if time.monotonic() >= next_tick:  # the reconciler's tick (timeouts, staleness, admission), each second
            pending.extend(await core.tick(time.time()))
            next_tick = time.monotonic() + 1.0
        await store.sync()
        trained = core.metrics.counters["trained_samples"]
        if start is None and trained:
            start = (time.perf_counter(), self_cpu_s(), sum(cpu_s(p) for p in servers), trained)
    assert start is not None, "no batch trained"
    elapsed = time.perf_counter() - start[0]
    num = trained - start[3]
    own = 1e3 * (self_cpu_s() - start[1]) / num
    nats = 1e3 * (sum(cpu_s(p) for p in servers) - start[2]) / num
    live = sum(1 for s in core.slots if s.is_live)
    await store.close()

    # resume from the store, the table as it is now (in flight), until the resumed core's writes are durable
    gc.collect()
    t0, own0, nats0 = time.perf_counter(), self_cpu_s(), sum(cpu_s(p) for p in servers)
    store2 = await PipelinedKVSlotStore.open(bus, bucket, args.ack_timeout_s)
    resumed2 = await Lifecycle.resume(store2, source, config, time.time(), num_rollout_actors=1)
    await store2.sync()
    resume_s = time.perf_counter() - t0
    resume_cpu = {"reconciler": round(self_cpu_s() - own0, 3),
                  "nats_servers": round(sum(cpu_s(p) for p in servers) - nats0, 3)}
    await store2.close()
    del resumed2, core, resumed, pending
    gc.collect()
    # the table's memory: what a resumed core holds (traced, so timed apart from the resume above)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store3 = await PipelinedKVSlotStore.open(bus, bucket, args.ack_timeout_s)
    resumed3 = await Lifecycle.resume(store3, source, config, time.time(), num_rollout_actors=1)
    await store3.sync()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    await store3.close()
    del resumed3
    info = await bus.js_reads.stream_info(f"KV_{bucket}")
    await bus.js.delete_stream(f"KV_{bucket}")
    return {
        "slots": num_slots, "batch_groups": b, "live_slots_at_stop": live,
        "lifecycles_per_s": round(num / elapsed, 1), "trained_samples_measured": num,
        "cpu_ms_per_lifecycle": {"reconciler": round(own, 4), "nats_servers": round(nats, 4),
                                 "total": round(own + nats, 4)},
        "resume_s": round(resume_s, 3), "resume_cpu_s": resume_cpu,
        "memory_bytes_per_slot": round(held / num_slots, 1),
        "bucket_bytes": info.state.bytes, "bucket_bytes_per_slot": round(info.state.bytes / num_slots, 1),
        "bucket_messages": info.state.messages,
    }


# --- actors -----------------------------------------------------------------------------------------------
async def simulate_actors(url: str, num: int, lease_s: float) -> None:
    """The child: ``num`` actors' leases, renewed every third of ``lease_s``, and their metrics answered."""
    buses: list[Bus] = []
    try:
        for first in range(0, num, ACTORS_PER_CONNECTION):
            bus = await Bus.connect(url, name=f"sim-actors-{first}", limits=BusLimits(replicas=3))
            buses.append(bus)
        async with asyncio.TaskGroup() as tg:
            for i in range(num):
                tg.create_task(_one_actor(buses[i // ACTORS_PER_CONNECTION], i, lease_s))
            print("ready", flush=True)
    finally:
        for bus in buses:
            await bus.close()


def registration_value(actor_id: str, lease_s: float) -> bytes:
    """A registry entry as `runtime.actor.Actor.describe` writes it (every field `decode_registration` checks)."""
    return msgpack.packb({"kind": "rollout", "id": actor_id, "pid": os.getpid(), "host": "bench", "code_hash": "0",
                          "state": "running", "failure": "", "num_inflight": 0, "num_handled": 0, "num_failed": 0,
                          "num_dead_lettered": 0, "num_refused_senders": 0, "num_rejected_config": 0,
                          "uptime_s": 1.0, "lease_s": lease_s}, use_bin_type=True)


async def _one_actor(bus: Bus, i: int, lease_s: float) -> None:
    actor_id = f"rollout-{i}-{secrets.token_hex(3)}"
    reply = msgpack.packb({"ok": True, "text": METRICS_TEXT.format(n=i)}, use_bin_type=True)

    async def answer(msg: Any) -> None:
        await msg.respond(reply)

    await bus.nc.subscribe(control_subject("rollout", actor_id, "metrics"), cb=answer)
    value = registration_value(actor_id, lease_s)
    await asyncio.sleep(lease_s / 3 * (i / 1000 % 1))  # renewals spread over the period, as started actors are
    while True:
        await bus.kv_put("actors", registration_key("rollout", actor_id), value, ttl_s=lease_s)
        await asyncio.sleep(lease_s / 3)


async def actors_trial(bus: Bus, url: str, num: int, args: argparse.Namespace) -> dict[str, Any]:
    lease_s = args.lease_s
    child = subprocess.Popen(  # noqa: ASYNC220 - started once, before timing
        [sys.executable, "-m", "tests.bench.scale", "--simulate-actors", str(num), "--url", url,
         "--lease-s", str(lease_s)],
        cwd=REPO, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        if line.strip() != b"ready":
            raise RuntimeError(f"the simulated actors did not start ({line!r})")
        view = RegistryView(lease_bound_s=lease_s * 3)
        lost: list[str] = []
        counts: collections.Counter[str] = collections.Counter()
        all_running = asyncio.Event()

        async def follow() -> None:
            async for entry in bus.kv_watch("actors"):
                if entry is None or (registered := parse_registration_key(entry.key)) is None:
                    continue
                value = entry.value if not entry.deleted and entry.value else None
                if (gone := view.observe(registered[1], value, time.monotonic(), expired=entry.purged)) is not None:
                    lost.append(gone.actor_id)
                if view.num_running("rollout") == num:  # the reconciler reads the count on every event
                    all_running.set()
                counts["events"] += 1

        async def expire() -> None:
            while True:
                await asyncio.sleep(1.0)
                lost.extend(x.actor_id for x in view.expire(time.monotonic()))

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(follow()), tg.create_task(expire())]
            async with asyncio.timeout(args.lease_s * 3 + 30):  # every actor registered and seen
                await all_running.wait()
            info0 = await bus.js_reads.stream_info("KV_actors")
            events0, cpu0, t0 = counts["events"], self_cpu_s(), time.perf_counter()
            await asyncio.sleep(args.window_s)
            events, cpu, window = counts["events"] - events0, self_cpu_s() - cpu0, time.perf_counter() - t0
            info1 = await bus.js_reads.stream_info("KV_actors")
            running = view.num_running("rollout")
            # one Prometheus scrape of every actor
            scrape_cpu0, s0 = self_cpu_s(), time.perf_counter()
            text = await prometheus.scrape(bus, "bench", "bench")
            scrape_s, scrape_cpu = time.perf_counter() - s0, self_cpu_s() - scrape_cpu0
            for t in tasks:
                t.cancel()
        up = [line for line in text.decode().splitlines() if line.startswith("asyncrl_scrape_up{")]
        num_up = sum(line.endswith(" 1.0") for line in up)
        renewals = info1.state.last_seq - info0.state.last_seq
        renewal_bytes = len(registration_key("rollout", "rollout-0-0")) + len(registration_value("rollout-0", lease_s))
        expected = num * 3 / lease_s
        return {
            "actors": num, "lease_s": lease_s, "window_s": round(window, 2),
            "renewals_per_s": round(renewals / window, 1), "renewals_per_s_expected": round(expected, 1),
            # a renewal's key and value (the headers and the replication to two more servers come beside)
            "renewal_payload_bytes_per_s": round(renewals / window * renewal_bytes, 1),
            "registry_events_seen_per_s": round(events / window, 1),
            "registry_follow_cpu_us_per_renewal": round(1e6 * cpu / max(1, events), 1),
            "registry_follow_cpu_share": round(cpu / window, 4),
            "running_seen": running, "wrongly_lost": len(lost),
            "leases_within_bounds": running == num and not lost and renewals >= 0.8 * expected * window,
            "scrape_s": round(scrape_s, 3), "scrape_cpu_s": round(scrape_cpu, 3), "scrape_actors_up": num_up,
            "scrape_bytes": len(text),
            "scrape_within_bound": scrape_s <= SCRAPE_BOUND_S and num_up == num,
        }
    finally:
        child.terminate()
        await asyncio.to_thread(child.wait, 30)
        await bus.js.purge_stream("KV_actors")


# --- report -----------------------------------------------------------------------------------------------
async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    result: dict[str, Any] = {"bench": "scale", "params": vars(args), "cpus": os.cpu_count()}
    try:
        async with NatsCluster(NatsServerConfig(store_dir=work / "nats"), size=3) as cluster:
            servers = [s.pid for s in cluster.servers if s.pid]
            bus = await Bus.connect(cluster.url, name="bench-scale", limits=BusLimits(replicas=3))
            try:
                await bus.ensure_base(lease_max_s=args.lease_s * 3)
                result["slots"] = []
                for num_slots in args.slots:
                    result["slots"].append(await slots_trial(bus, servers, num_slots, args))
                    print(f"slots {num_slots}: {result['slots'][-1]}", file=sys.stderr, flush=True)
                result["actors"] = []
                for num in args.actors:
                    result["actors"].append(await actors_trial(bus, cluster.url, num, args))
                    print(f"actors {num}: {result['actors'][-1]}", file=sys.stderr, flush=True)
            finally:
                await bus.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_size = {r["slots"]: r for r in result["slots"]}
    if 1000 in by_size and 100_000 in by_size:
        large, small = by_size[100_000]["cpu_ms_per_lifecycle"], by_size[1000]["cpu_ms_per_lifecycle"]
        result["cpu_per_lifecycle_ratio_1e5_over_1e3"] = round(large["reconciler"] / small["reconciler"], 3)
        result["cpu_total_per_lifecycle_ratio_1e5_over_1e3"] = round(large["total"] / small["total"], 3)
    if 100_000 in by_size:
        result["resume_s_at_1e5"] = by_size[100_000]["resume_s"]
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench (or, with ``--simulate-actors``, the actors' child) and prints its JSON line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=_ints, default=[100, 1000, 100_000])
    p.add_argument("--actors", type=_ints, default=[10, 100, 1000])
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--tables", type=float, default=2.0, help="samples measured per size, in tables' worth")
    p.add_argument("--sync-every", type=int, default=256, help="events per group commit (the reconciler's "
                   "events run through the core while the previous sync is in flight)")
    p.add_argument("--ack-timeout-s", type=float, default=60.0, help="the store's wait for its writes' "
                   "acknowledgements (the reconciler's is 10 s; a bench beside other work may wait longer)")
    p.add_argument("--lease-s", type=float, default=10.0)
    p.add_argument("--window-s", type=float, default=20.0, help="seconds the registry is followed per count")
    p.add_argument("--simulate-actors", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(40),
    )
    import uvloop

    if args.simulate_actors:
        uvloop.run(simulate_actors(args.url, args.simulate_actors, args.lease_s))
        return {}
    result = uvloop.run(main_async(args))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
