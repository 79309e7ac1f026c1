"""Benchmark: sample lifecycles per second, the reconciler on NATS vs a central controller on Ray.

    .venv/bin/python -m tests.bench.lifecycle [--prompts 500] [--group-size 4] [--trials 2]

Both sides move the same samples through the same lifecycle (rollout → reward per sample; group per
G samples; train per B groups, one batch at a time, under the same staleness bound) with no-op stages:

- NATS: a real run (``python -m runtime.up``) of the real `actors.reconciler.ReconcilerActor`, its
  table in the ``slots`` JetStream KV bucket (file storage, every transition a compare-and-set), work
  orders and completions on JetStream streams (a group's rollout and reward orders, and their
  completions, one message each: `actors.reconciler.work.RolloutGroupOrder`), and the simulated stage actors of
  tests/integration/sim_stages.py with zero work time and no blob records, one process per kind.
  Durability on: everything the reconciler decides is in JetStream before it is acted on.
- Ray: the design verl and OpenRLHF use: a driver loop (this process) calling rollout, reward, group
  and train Ray actors (local Ray, ``num_cpus=2``) with asyncio awaits, one call per group per stage
  (a group's G samples in one rollout call and one reward call) and one train call per batch, as verl
  sends its workers batches, admitting groups under the same bound; state in the driver's memory only.

Lifecycles/s = samples trained after the first batch / seconds from the first trained batch to the last
(NATS: read from the trainer's ledger, whose entries carry their time). CPU per lifecycle, both sides the
same way (`CpuSampler`): every process of the side read every 0.1 s (NATS: the reconciler, the stage
actors, nats-server; Ray: the driver, GCS, raylet, workers, Ray's other processes), over the samples
nearest outside the span from the first trained batch to the last.
Latency = per stage, from issuing the work to accepting its completion (queue time included); the
NATS side reports the reconciler's own p50/p99 (`actors.reconciler.metrics`). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import structlog
from nats.errors import NoRespondersError

from actors.reconciler.actor import ReconcilerActor
from runtime.bus import Bus
from runtime.bus_auth import SUPERVISOR, control_subject
from runtime.rundir import RunInfo
from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml

REPO = Path(__file__).resolve().parents[2]
NOOP = StageSim(median_s=0.0, sigma=0.0)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- CPU accounting from /proc: the machine is shared, so CPU per lifecycle is the robust figure ---------
def process_tree(root: int) -> dict[int, str]:
    """pid -> command line of root and every live descendant."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, p in parents.items() if p == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    out = {}
    for pid in tree:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def role_of(cmdline: str) -> str:
    if "--kind reconciler" in cmdline:
        return "reconciler"
    if "--kind dashboard" in cmdline:
        return "dashboard"
    if "actor_process" in cmdline:
        return "stages"
    if "nats-server" in cmdline:
        return "nats_server"
    return "supervisor_and_other"


def cpu_by_role(root: int) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for pid, cmdline in process_tree(root).items():
        out[role_of(cmdline)] += cpu_s(pid)
    return dict(out)


def cpu_ms_per_lifecycle(before: dict[str, float], after: dict[str, float], num: int) -> dict[str, float]:
    out = {role: 1e3 * (after.get(role, 0.0) - before.get(role, 0.0)) / num for role in after}
    out["total"] = sum(out.values())
    return out


class CpuSampler:
    """Both sides' CPU, counted the same way: every ``interval_s`` a thread reads the CPU seconds of every
    process of the side (``read``: role -> seconds), and a trial's figure is the difference between the
    samples nearest outside its steady span [first trained batch, last trained batch], over the samples
    trained inside that window. The thread's own CPU is subtracted from ``own_role`` when the sampler runs
    inside a measured process (the Ray driver), so the measuring costs neither side."""

    def __init__(self, read: Any, interval_s: float = 0.1, own_role: str | None = None) -> None:
        self._read, self._interval_s, self._own_role = read, interval_s, own_role
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            cpu = self._read()
            if self._own_role is not None:
                cpu[self._own_role] = cpu.get(self._own_role, 0.0) - time.thread_time()
            self.samples.append((time.time(), cpu))
            if self._stop.is_set():
                return
            self._stop.wait(self._interval_s)  # one more sample after the stop: the window's end

    def per_lifecycle(self, batches: list[tuple[float, int]]) -> dict[str, float]:
        """CPU-ms per trained sample over the window around [first batch, last batch] (``batches``: (time, samples))."""
        first, last = batches[0][0], batches[-1][0]
        before = max((c for c in self.samples if c[0] <= first), key=lambda c: c[0], default=self.samples[0])
        after = min((c for c in self.samples if c[0] >= last), key=lambda c: c[0], default=self.samples[-1])
        in_window = sum(n for t, n in batches if before[0] < t <= after[0])
        return cpu_ms_per_lifecycle(before[1], after[1], in_window)


# --- NATS: the real reconciler in a real run ----------------------------------------------------------
class SerialReconcilerActor(ReconcilerActor):
    """The reconciler with one KV round trip per write (no group commit): the before of this bench."""

    pipelined_writes = False


RECONCILERS = {
    "nats": "actors.reconciler:ReconcilerActor",
    "nats_serial": "tests.bench.lifecycle:SerialReconcilerActor",
    "nats_dashboard": "actors.reconciler:ReconcilerActor",  # the same run, its dashboard up and watched
}
# The dashboard as the default run has it, on any free port; a browser's worth of load: one live stream.
DASHBOARD_RUN = """
[dashboard]
port = 0

[actors.dashboard]
entry = "ops.dashboard.actor:DashboardActor"
count = 1
max_concurrency = 1
nice = 10
"""


async def nats_trial(args: argparse.Namespace, work_dir: Path, reconciler_entry: str,
                     dashboard: bool = False, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run of the NATS side; ``extra``: more runtime.up arguments (tests.bench.placement: the Ray backend)."""
    run_dir = work_dir / "run"
    SimConfig(rollout=NOOP, reward=NOOP, group=NOOP, train=NOOP, records=False, heartbeat_s=5.0).write(run_dir)
    config = work_dir / "run.toml"
    text = sim_run_toml(
        num_prompts=args.prompts,
        num_slots=args.slots,
        group_size=args.group_size,
        batch_groups=args.batch_groups,
        eta=args.eta,
        rollout_count=1,
        reward_count=1,
        reconciler_entry=reconciler_entry,
        max_inflight_per_rollout_actor=args.max_inflight_per_rollout_actor or args.slots,
        stage_timeout_s=30.0,  # no-op stages never need a retry; a loaded machine must not cause storms of them
    )
    config.write_text(text + (DASHBOARD_RUN if dashboard else ""))
    out = open(work_dir / "up.out", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before timing
        [sys.executable, "-m", "runtime.up", "--config", str(config), "--run-dir", str(run_dir), "--quiet",
         "--set", f"bus.auth={'true' if args.auth == 'on' else 'false'}", *extra],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out.close()
    try:
        async with asyncio.timeout(90):
            while not (run_dir / "run.json").exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"runtime.up exited {proc.returncode}: {(work_dir / 'up.out').read_text()}")
                await asyncio.sleep(0.05)
        info = RunInfo.read(run_dir)
        bus = await Bus.connect(info.nats_url, name="bench", **info.bus_options(SUPERVISOR))
        try:
            if not dashboard:
                return await _watch_run(args, bus, proc.pid)
            async with asyncio.TaskGroup() as tg:
                viewer = tg.create_task(_watch_dashboard(bus))
                result = await _watch_run(args, bus, proc.pid)
                viewer.cancel()
            return result
        finally:
            await bus.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 120)


async def _watch_dashboard(bus: Bus) -> None:
    """A browser's load on the dashboard: its live stream read as fast as it comes, until cancelled."""
    import aiohttp

    async with asyncio.timeout(60):
        while True:  # the dashboard actor registers once its server is up
            actors = (await _request(bus, "ctl.supervisor.status"))["actors"]
            ids = [a["id"] for a in actors if a["kind"] == "dashboard"]
            try:
                url = (await _request(bus, control_subject("dashboard", ids[0], "status"))).get("url") if ids else ""
            except Exception:  # started, not listening yet
                url = ""
            if url:
                break
            await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as session, session.get(url + "api/stream") as stream:
        async for _ in stream.content.iter_any():
            pass


async def _request(bus: Bus, subject: str) -> dict[str, Any]:
    reply = await bus.nc.request(subject, b"", timeout=10.0)
    return msgpack.unpackb(reply.data, raw=False)


async def _watch_run(args: argparse.Namespace, bus: Bus, root_pid: int) -> dict[str, Any]:
    """Waits until the reconciler reports the dataset done; reads its figures and the trainer's ledger."""
    ledger = TrainerLedger(await bus.kv(LEDGER_BUCKET))
    with CpuSampler(lambda: cpu_by_role(root_pid)) as cpu:
        status = await _until_finished(args, bus)
    state, _ = await ledger.load()
    lc = status["lifecycle"]
    batches = sorted((b["time"], len(b["sample_ids"])) for b in state["trained"].values())
    return {
        **steady_rate(batches),
        "cpu_ms_per_lifecycle": cpu.per_lifecycle(batches),
        "stage_p50_ms": {k: 1e3 * v["p50_s"] for k, v in lc["stage_latency"].items()},
        "stage_p99_ms": {k: 1e3 * v["p99_s"] for k, v in lc["stage_latency"].items()},
        "slot_writes_per_sample": lc["counters"]["slot_writes"] / max(1, lc["counters"]["trained_samples"]),
        "retries": lc["counters"].get("retries", 0),
        "ignored_completions": lc["counters"].get("ignored_completions", 0),
    }


async def _until_finished(args: argparse.Namespace, bus: Bus) -> dict[str, Any]:
    """The reconciler's status once it reports the dataset done."""
    async with asyncio.timeout(args.timeout_s):
        while True:
            await asyncio.sleep(0.2)
            try:
                actors = (await _request(bus, "ctl.supervisor.status"))["actors"]
            except NoRespondersError:  # run.json is written just before the supervisor listens
                continue
            reconciler = [a["id"] for a in actors if a["kind"] == "reconciler"]
            if not reconciler:
                continue
            try:
                status = await _request(bus, control_subject("reconciler", reconciler[0], "status"))
            except Exception:  # not consuming yet
                continue
            if status.get("finished"):
                return status


def steady_rate(batches: list[tuple[float, int]]) -> dict[str, Any]:
    """Samples/s between the first and the last trained batch (start-up and pipeline fill excluded)."""
    elapsed = batches[-1][0] - batches[0][0]
    num = sum(n for _, n in batches[1:])
    return {"lifecycles_per_s": num / elapsed, "trained_samples": sum(n for _, n in batches), "elapsed_s": elapsed}


# --- Ray: a central controller calling stage actors -----------------------------------------------------
# One call per group per stage, as verl sends batches to its workers: a group's G rollouts in one call, its
# G rewards in one call, its advantages in one call, a batch of B groups in one train call.
class RayRollout:
    async def rollout(self, group_id: str, sample_ids: list[str], version: int) -> list[tuple[str, int]]:
        return [(sample_id, version) for sample_id in sample_ids]


class RayReward:
    async def reward(self, sample_ids: list[str]) -> list[float]:
        return [float(hash(sample_id) % 1000) / 1000.0 for sample_id in sample_ids]


class RayGroup:
    async def group(self, group_id: str, rewards: list[float]) -> list[float]:
        mean = sum(rewards) / len(rewards)
        return [r - mean for r in rewards]


class RayTrain:
    def __init__(self) -> None:
        self.version = 0

    async def train(self, batch: list[str]) -> int:
        self.version += 1
        return self.version


class Controller:
    """The driver loop: admits whole groups under the AReaL bound, awaits stage calls, trains batches."""

    def __init__(self, args: argparse.Namespace, actors: dict[str, Any]) -> None:
        self.args = args
        self.actors = actors
        self.version = 0
        self.live_groups = 0
        self.ready: collections.deque[str] = collections.deque()
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.batches: list[tuple[float, int]] = []
        self.wake = asyncio.Condition()

    async def _call(self, stage: str, method: Any, *call_args: Any) -> Any:
        t0 = time.perf_counter()
        result = await method.remote(*call_args)
        self.latency[stage].append(time.perf_counter() - t0)
        return result

    async def _group(self, position: int) -> None:
        group_id = f"e0-p{position}"
        sample_ids = [f"{group_id}-s{j}" for j in range(self.args.group_size)]
        await self._call("rollout", self.actors["rollout"].rollout, group_id, sample_ids, self.version)
        rewards = await self._call("reward", self.actors["reward"].reward, sample_ids)
        await self._call("group", self.actors["group"].group, group_id, rewards)
        async with self.wake:
            self.ready.append(group_id)
            self.wake.notify_all()

    async def _trainer(self, num_groups: int) -> None:
        done = 0
        while done < num_groups:
            size = min(self.args.batch_groups, num_groups - done)
            async with self.wake:
                await self.wake.wait_for(lambda size=size: len(self.ready) >= size)
                batch = [self.ready.popleft() for _ in range(size)]
            self.version = await self._call("train", self.actors["train"].train, batch)
            done += len(batch)
            self.batches.append((time.time(), len(batch) * self.args.group_size))
            async with self.wake:
                self.live_groups -= len(batch)
                self.wake.notify_all()

    async def run(self) -> None:
        a = self.args
        cap = min((a.eta + 1) * a.batch_groups, a.slots // a.group_size)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._trainer(a.prompts))
            for position in range(a.prompts):
                async with self.wake:
                    await self.wake.wait_for(lambda: self.live_groups < cap)
                    self.live_groups += 1
                tg.create_task(self._group(position))


async def ray_trial(args: argparse.Namespace, actors: dict[str, Any],
                    calls_out: dict[str, int] | None = None) -> dict[str, Any]:
    """One trial of the Ray side; ``calls_out`` gets the number of calls made to each stage."""
    controller = Controller(args, actors)
    with CpuSampler(ray_cpu, own_role="driver") as cpu:
        await controller.run()
    if calls_out is not None:
        calls_out.update({stage: len(latencies) for stage, latencies in controller.latency.items()})
    return {
        **steady_rate(controller.batches),
        "cpu_ms_per_lifecycle": cpu.per_lifecycle(controller.batches),
        "stage_p50_ms": {k: 1e3 * statistics.median(v) for k, v in controller.latency.items()},
        "stage_p99_ms": {k: 1e3 * statistics.quantiles(v, n=100)[98] for k, v in controller.latency.items()},
    }


def ray_cpu() -> dict[str, float]:
    """CPU seconds of the driver (this process, its controller loop) and of every Ray process under it: the
    GCS, the raylet, the stage actors' workers and Ray's other processes (its agents, log monitor)."""
    me = os.getpid()
    out = {"driver": cpu_s(me), "gcs": 0.0, "raylet": 0.0, "workers": 0.0, "ray_other": 0.0}
    for pid, cmdline in process_tree(me).items():
        if pid != me:
            out[ray_role_of(cmdline)] += cpu_s(pid)
    return out


def ray_role_of(cmdline: str) -> str:
    if "gcs_server" in cmdline:
        return "gcs"
    if "/raylet " in cmdline or cmdline.startswith("raylet"):
        return "raylet"
    if (cmdline.startswith("ray::") and "Agent" not in cmdline) or "default_worker.py" in cmdline:
        return "workers"
    return "ray_other"


def start_ray() -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    classes = {"rollout": RayRollout, "reward": RayReward, "group": RayGroup, "train": RayTrain}
    return {k: ray.remote(num_cpus=0, max_concurrency=256)(c).remote() for k, c in classes.items()}


# --- report --------------------------------------------------------------------------------------------
def _median_of(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in trials[0].items():
        if isinstance(value, dict):
            out[key] = {k: round(statistics.median(t[key][k] for t in trials), 3) for k in value}
        else:
            out[key] = round(statistics.median(t[key] for t in trials), 3)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides}
    actors = start_ray() if "ray" in args.sides else {}
    try:
        if actors:
            await ray_trial(argparse.Namespace(**{**vars(args), "prompts": 20}), actors)  # warm-up
        for trial in range(args.trials):  # the sides alternate, so the machine's load hits both alike
            for side in [s for s in runs if s in RECONCILERS]:
                work_dir = Path(tempfile.mkdtemp(prefix="bench-lifecycle-"))
                try:
                    runs[side].append(await nats_trial(args, work_dir, RECONCILERS[side],
                                                       dashboard=side == "nats_dashboard"))
                finally:
                    shutil.rmtree(work_dir, ignore_errors=True)
            if "ray" in runs:
                runs["ray"].append(await ray_trial(args, actors))
            print(f"trial {trial}: " + " ".join(f"{k}={v[-1]}" for k, v in runs.items()), file=sys.stderr)
    finally:
        if actors:
            import ray

            ray.shutdown()
    result: dict[str, Any] = {
        "bench": "lifecycle",
        "params": {k: v for k, v in vars(args).items() if k != "timeout_s"},
        "cpus": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    names = {
        "nats": "nats_reconciler_durable",
        "nats_serial": "nats_reconciler_durable_one_round_trip_per_write",
        "nats_dashboard": "nats_reconciler_durable_with_dashboard_watched",
        "ray": "ray_central_controller",
    }
    for side, trials in runs.items():
        result[names[side]] = _median_of(trials)
    if "nats" in runs and "nats_dashboard" in runs:
        plain, watched = result[names["nats"]], result[names["nats_dashboard"]]
        result["dashboard_cost_fraction_of_lifecycles_per_s"] = round(
            1 - watched["lifecycles_per_s"] / plain["lifecycles_per_s"], 4)
        result["dashboard_cpu_ms_per_lifecycle"] = watched["cpu_ms_per_lifecycle"].get("dashboard", 0.0)
    if "nats" in runs and "ray" in runs:
        nats, ray_side = result[names["nats"]], result[names["ray"]]
        result["ratio_lifecycles_per_s_nats_over_ray"] = round(
            nats["lifecycles_per_s"] / ray_side["lifecycles_per_s"], 3
        )
        result["ratio_cpu_per_lifecycle_nats_over_ray"] = round(
            nats["cpu_ms_per_lifecycle"]["total"] / ray_side["cpu_ms_per_lifecycle"]["total"], 3
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=500, help="groups per trial (the task set holds 524)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--max-inflight-per-rollout-actor",
        type=int,
        default=0,
        help="the NATS side's in-flight rollout cap (one rollout actor); 0: --slots, the Ray controller "
        "having no such cap (its in-flight work is bounded by the staleness bound and the slots only)",
    )
    p.add_argument(
        "--sides",
        type=lambda v: v.split(","),
        default=["nats", "ray"],
        help="of nats, nats_serial (the reconciler without group commit), nats_dashboard (nats with the "
        "dashboard actor up and its live stream read), ray",
    )
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--auth", choices=["on", "off"], default="on",
                   help="the NATS side's bus authentication and per-role permissions (runtime.bus_auth)")
    args = p.parse_args()
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    import uvloop

    print(json.dumps(uvloop.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
