"""The Ray placement backend on a real Ray cluster of three nodes on this machine (ray.cluster_utils):
a head and two workers with distinct custom resources and labels. Actors land where their resources
ask, a hot swap ships the code on disk through Ray's working_dir, and a worker node removed mid-run
has its actors placed again on the nodes that remain with every prompt trained once or accounted.

Kept small (Ray is heavy on two shared cores): one cluster for the module, a CPU or two per node,
shut down at the end whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.codec import Codec
from runtime.events import parse_event
from runtime.ray_host import RAY_WORKER_ENV
from tests.integration.harness import REPO, LiveRun, alive, run_events, write_config
from tests.integration.test_actor_runtime import _environment
from tests.integration.workers import CountRequest
from tests.waiting import until

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("ray_backend_cluster")]  # one worker: one cluster

PLACED_RUN = """
[supervisor]
max_restarts = 10
backoff_base_s = 0.2

[actors.sandboxed]
entry = "tests.integration.workers:CounterActor"
count = 2
heartbeat_s = 1.0
[actors.sandboxed.placement]
resources = {{sandbox = 1}}
node_labels = {{zone = "a"}}

[actors.trained]
entry = "tests.integration.workers:CounterActor"
count = 1
heartbeat_s = 1.0
nice = 7
threads = 0
[actors.trained.placement]
num_cpus = 0.5
resources = {{trainer = 1}}
strategy = "{strategy}"
"""


# the head's node health checks the cluster guide ships (docs/cluster.md, "Node loss and health checks")
HEALTH_CHECKS = json.loads((REPO / "runtime" / "ray_health_checks.json").read_text())
# name -> ray.cluster_utils add_node options; the first is the head
NODES: dict[str, dict[str, Any]] = {
    "head": {"num_cpus": 1, "resources": {"sandbox": 8}, "_system_config": HEALTH_CHECKS},
    "a": {"num_cpus": 1, "resources": {"sandbox": 8}, "labels": {"zone": "a"}},
    "b": {"num_cpus": 1, "resources": {"trainer": 2}, "labels": {"zone": "b"}},
}


class RayCluster:
    """A Ray cluster of ``nodes`` on this machine (by default: a head with `sandbox` resources and two
    workers: ``a`` (`sandbox`, label zone=a), ``b`` (`trainer`, zone=b))."""

    def __init__(self, nodes: dict[str, dict[str, Any]] = NODES) -> None:
        self.cluster = ray_cluster_utils.Cluster(shutdown_at_exit=True)
        self.nodes: dict[str, Any] = {}
        try:
            for name, options in nodes.items():
                self.nodes[name] = self.cluster.add_node(**options)
            self.cluster.wait_for_nodes()
        except BaseException:  # a half-started cluster is shut down too
            self.cluster.shutdown()
            raise

    @property
    def address(self) -> str:
        return self.cluster.address

    def name_of(self, node_field: str) -> str:
        """Which node an actor's ``node`` (``host/<node id prefix>``, the supervisor's word) is."""
        prefix = node_field.rsplit("/", 1)[-1]
        return next((name for name, node in self.nodes.items() if node.node_id.startswith(prefix)),
                    f"unknown {node_field}")

    def raylet_pid(self, name: str) -> int:
        return self.nodes[name].all_processes["raylet"][0].process.pid

    def node_of_pid(self, pid: int) -> str:
        """Which node a process runs on, by the operating system's word, not Ray's or the supervisor's: the
        node whose raylet is among its ancestors (the raylet starts the Ray worker that starts the process)."""
        raylets = {self.raylet_pid(name): name for name in self.nodes}
        ancestry, at = [], pid
        while at > 1:
            if at in raylets:
                return raylets[at]
            ancestry.append(at)
            try:
                at = int(Path(f"/proc/{at}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        return f"no node's raylet above {ancestry}"


@contextlib.contextmanager
def ray_cluster_of(nodes: dict[str, dict[str, Any]]) -> Iterator[RayCluster]:
    """A `RayCluster` of ``nodes``, shut down at the end whatever happens."""
    try:
        cluster = RayCluster(nodes)
    except Exception:  # a node that timed out starting on a loaded machine: once more
        cluster = RayCluster(nodes)
    try:
        yield cluster
    finally:
        cluster.cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    with ray_cluster_of(NODES) as cluster:
        yield cluster


def _ray_args(cluster: RayCluster, *extra: str) -> tuple[str, ...]:
    return ("--set", 'runtime.backend="ray"', "--set", f'runtime.ray_address="{cluster.address}"', *extra)


async def _nodes_by_kind(run: LiveRun, cluster: RayCluster) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in await run.actors():
        if not a["retiring"]:
            out.setdefault(a["kind"], []).append(cluster.name_of(a["node"]))
    return out


def _start_order(run_dir: Path) -> list[str]:
    """The supervisor's start events in the order it logged them."""
    rows = [parse_event(line) for line in (run_dir / "logs" / "supervisor.jsonl").read_text().splitlines()]
    return [r["event"] for r in rows if r and r.get("event") in ("actor_starting", "actor_spawned")]


async def test_actors_land_on_the_nodes_their_resources_ask_for(tmp_path: Path, ray_cluster: RayCluster) -> None:
    cfg = write_config(tmp_path / "run.toml", PLACED_RUN.format(strategy="pack"))
    run = await LiveRun(tmp_path / "run", cfg, *_ray_args(ray_cluster)).start(timeout_s=120)
    try:
        sandboxed = await run.wait_actors("sandboxed", 2, timeout_s=180)
        await run.wait_actors("trained", 1, timeout_s=180)
        assert await _nodes_by_kind(run, ray_cluster) == {"sandboxed": ["a", "a"], "trained": ["b"]}
        # placed together, not one after another: the supervisor asked for all three before any was placed
        assert _start_order(run.run_dir)[:4] == ["actor_starting"] * 3 + ["actor_spawned"], _start_order(run.run_dir)
        # one OS process each, running the actor itself, niced as configured, started by the node's Ray worker
        trained = (await run.wait_actors("trained", 1))[0]
        niceness = {a["id"]: int(Path(f"/proc/{a['pid']}/stat").read_text().split()[18]) for a in [trained, *sandboxed]}
        assert niceness[trained["id"]] - niceness[sandboxed[0]["id"]] == 7, f"nice reaches Ray's processes: {niceness}"
        cmdline = Path(f"/proc/{trained['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"runtime.actor_process" in cmdline and trained["id"].encode() in cmdline
        # the node's environment (its raylet's: this process's), not what Ray sets for its own workers:
        # ``threads = 0`` leaves torch's default, as it does locally, not Ray's OMP_NUM_THREADS=1
        assert ray_cluster.node_of_pid(trained["pid"]) == "b"
        env, node_env = _environment(trained["pid"]), _environment(ray_cluster.raylet_pid("b"))
        assert {k: env.get(k) for k in RAY_WORKER_ENV} == {k: node_env.get(k) for k in RAY_WORKER_ENV}, env
        # its events reach ops.tail through the bus's LOG stream (not the node's files)
        tail = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "ops.tail", str(run.run_dir), "--since", "10m", "--no-follow", "--json",
            "--actor", trained["id"], "--event", "actor_running"], cwd=REPO, capture_output=True, text=True,
            timeout=60)
        assert trained["id"] in tail.stdout and "actor_running" in tail.stdout, tail.stdout + tail.stderr
        # a crash is ours to restart (Ray's restarts are off): a new process, a new id, on a node that fits
        os.kill(sandboxed[0]["pid"], signal.SIGKILL)

        async def replaced() -> bool:  # one reading of the registry: a new actor in its place, on node a
            running = [a for a in await run.actors() if a["kind"] == "sandboxed" and not a["retiring"]]
            new = {a["id"] for a in running} - {a["id"] for a in sandboxed}
            return len(running) == 2 and len(new) == 1 and all(ray_cluster.name_of(a["node"]) == "a" for a in running)

        await until(replaced, 120, "the killed actor restarted by the supervisor on node a")
        crashed = run_events(run.run_dir, "actor_crashed")
        assert any(e.get("actor_id") == sandboxed[0]["id"] for e in crashed)
    finally:
        assert await run.stop(timeout_s=120) == 0
    assert not run_events(run.run_dir, "actor_lost_with_node")


async def test_a_kind_no_node_can_take_is_refused_before_anything_starts(tmp_path: Path,
                                                                        ray_cluster: RayCluster) -> None:
    cfg = write_config(tmp_path / "run.toml", PLACED_RUN.format(strategy="default").replace(
        "resources = {trainer = 1}", "resources = {trainer = 1, sandbox = 1}"))  # no node has both
    with pytest.raises(RuntimeError) as caught:
        await LiveRun(tmp_path / "run", cfg, *_ray_args(ray_cluster)).start(timeout_s=120)
    message = str(caught.value)
    assert "runtime.up exited 2" in message and "actors.trained.placement asks for" in message, message
    assert "no node of the Ray cluster" in message and not run_events(tmp_path / "run", "actor_starting")


async def test_a_stop_that_times_out_kills_the_process_on_its_node(tmp_path: Path, ray_cluster: RayCluster) -> None:
    """drain → TERM → KILL through the Ray actor: an actor busy past its drain and TERM timeouts is killed
    (its whole session, on node a), the run still stops cleanly, and no process is left behind."""
    cfg = write_config(tmp_path / "run.toml", """
[supervisor]
term_timeout_s = 1.0

[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = 1
drain_timeout_s = 1.0
heartbeat_s = 1.0
lease_s = 3.0
[actors.counter.placement]
resources = {sandbox = 1}
node_labels = {zone = "a"}
""")
    run = await LiveRun(tmp_path / "run", cfg, *_ray_args(ray_cluster)).start(timeout_s=120)
    try:
        assert run.bus is not None
        (actor,) = await run.wait_actors("counter", 1, timeout_s=180)
        await run.bus.publish_durable("work.count", await Codec([CountRequest]).encode(CountRequest("long", 600.0)),
                                      msg_id="long")

        async def busy() -> bool:
            entries = await run.wait_actors("counter", 1)
            return any(e["id"] == actor["id"] and e["num_inflight"] >= 1 for e in entries)

        await until(busy, 60, "the actor holding the long message")
    finally:
        assert await run.stop(timeout_s=120) == 0
    killed = [e for e in run_events(run.run_dir, "actor_killed") if e.get("actor_id") == actor["id"]]
    assert [e["reason"] for e in killed] == ["stop_timeout"], killed
    assert not alive(actor["pid"]), "the killed process is gone"


async def test_a_run_without_a_ray_address_starts_its_own_head(tmp_path: Path, ray_cluster: RayCluster,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``runtime.ray_address`` empty starts a new head even where ``RAY_ADDRESS`` names a running cluster (a
    shell on a Ray node; every actor process has it) or ``ray start`` left one on this machine: its actors
    are not placed on someone else's cluster."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)  # runtime.up inherits it
    cfg = write_config(tmp_path / "run.toml", """
[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = 1
heartbeat_s = 1.0
""")
    run = await LiveRun(tmp_path / "run", cfg, "--set", 'runtime.backend="ray"', "--set",
                        "runtime.ray_head_num_cpus=1").start(timeout_s=300)  # a head's start, under load
    try:
        (actor,) = await run.wait_actors("counter", 1, timeout_s=180)
        (connected,) = run_events(run.run_dir, "ray_connected")
        assert connected["started_head"] and connected["address"] != ray_cluster.address, connected
        assert ray_cluster.node_of_pid(actor["pid"]).startswith("no node"), "placed on the other cluster"
    finally:
        assert await run.stop(timeout_s=120) == 0


def _code_tree(root: Path, version: int) -> Path:
    """What a node needs to run the counter actor (the runtime, the test worker, the swapped module), as
    its own directory: shipped to the nodes by Ray's working_dir, not read from the repository."""
    root.mkdir(exist_ok=True)
    if not (root / "runtime").exists():
        shutil.copytree(REPO / "runtime", root / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
        (root / "tests" / "integration").mkdir(parents=True)
        for name in ("tests/__init__.py", "tests/integration/__init__.py", "tests/integration/workers.py"):
            shutil.copy(REPO / name, root / name)
    (root / "swapped_worker.py").write_text(
        f"from tests.integration.workers import CounterActor\nVERSION = {version}\n")
    return root


async def test_hot_swap_ships_the_new_code_to_the_nodes(tmp_path: Path, ray_cluster: RayCluster) -> None:
    code = _code_tree(tmp_path / "code", version=1)
    cfg = write_config(tmp_path / "run.toml", """
[actors.counter]
entry = "swapped_worker:CounterActor"
count = 1
heartbeat_s = 1.0
[actors.counter.placement]
resources = {sandbox = 1}
""")
    run = await LiveRun(tmp_path / "run", cfg, *_ray_args(ray_cluster, "--set", f'runtime.ray_working_dir="{code}"'),
                        pythonpath=(code,)).start(timeout_s=120)  # runtime.up reads the run's schema from it
    try:
        old = (await run.wait_actors("counter", 1, timeout_s=180))[0]
        old_dir = Path(f"/proc/{old['pid']}/cwd").resolve()
        assert old_dir != code and (old_dir / "swapped_worker.py").read_text().endswith("VERSION = 1\n"), old_dir
        _code_tree(code, version=2)
        report = await run.request("ctl.supervisor.swap", {"kind": "counter"}, timeout=240)
        assert report["ok"], report
        new = (await run.wait_actors("counter", 1))[0]
        assert new["id"] != old["id"] and new["code_hash"] != old["code_hash"], report
        new_dir = Path(f"/proc/{new['pid']}/cwd").resolve()
        assert new_dir != old_dir and (new_dir / "swapped_worker.py").read_text().endswith("VERSION = 2\n")
    finally:
        assert await run.stop(timeout_s=120) == 0


PLACEMENT_OF_STAGES = """
[actors.rollout.placement]
resources = {sandbox = 1}
strategy = "spread"

[actors.reward.placement]
resources = {sandbox = 1}
strategy = "spread"

[actors.trainer.placement]
resources = {trainer = 1}
"""


async def test_a_worker_node_removed_mid_run_loses_no_prompt(tmp_path: Path, ray_cluster: RayCluster) -> None:
    """Last in the module: node ``a`` is killed (its raylet and workers SIGKILLed: the head notices by its
    health checks, 3 s here). The stage actors on it are lost with it, placed
    again on the head (the other node with `sandbox`) at once, and their work is re-issued: every prompt
    is trained once or dropped with a reason, no group twice (the reconciler test's accounting)."""
    from tests.integration.sim_stages import LEDGER_BUCKET, SimConfig, StageSim, TrainerLedger, sim_run_toml
    from tests.integration.test_reconciler import _account, _durable_table, _num_trained_groups

    num_prompts, group_size, eta = 48, 4, 2
    run_dir = tmp_path / "run"
    SimConfig(rollout=StageSim(median_s=0.3, sigma=0.5, max_s=2.0), reward=StageSim(median_s=0.05, max_s=0.5),
              group=StageSim(median_s=0.02, max_s=0.2), train=StageSim(median_s=0.1, max_s=0.5), seed=3).write(run_dir)
    cfg = write_config(tmp_path / "run.toml", sim_run_toml(
        num_prompts=num_prompts, num_slots=32, group_size=group_size, batch_groups=4, eta=eta,
        rollout_count=2, reward_count=2, stage_timeout_s=30.0) + PLACEMENT_OF_STAGES)
    run = await LiveRun(run_dir, cfg, *_ray_args(ray_cluster)).start(timeout_s=120)
    try:
        assert run.bus is not None
        for kind, n in (("rollout", 2), ("reward", 2), ("trainer", 1)):
            await run.wait_actors(kind, n, timeout_s=240)
        status = await run.actors()
        before = {a["id"]: ray_cluster.name_of(a["node"]) for a in status}
        on_a = sorted(i for i, node in before.items() if node == "a")
        assert on_a, f"spread placed nothing on node a: {before}"
        assert all(node == "b" for i, node in before.items() if i.startswith("trainer-"))
        ledger = TrainerLedger(await run.bus.kv(LEDGER_BUCKET))
        await until(lambda: _num_trained_groups(ledger), 240, "a first trained batch")
        removed_at = time.monotonic()
        await asyncio.to_thread(ray_cluster.cluster.remove_node, ray_cluster.nodes["a"], False)  # SIGKILL: no goodbye

        async def replaced() -> dict[str, list[str]] | None:
            nodes = await _nodes_by_kind(run, ray_cluster)
            ok = all(len(nodes.get(k, [])) == n and "a" not in nodes[k] for k, n in (("rollout", 2), ("reward", 2)))
            return nodes if ok else None

        after = await until(replaced, 120, "the lost actors placed again on the remaining nodes")
        print(f"node a removed: {on_a} placed again on {after} within {time.monotonic() - removed_at:.1f}s")
        assert set(after["rollout"]) | set(after["reward"]) <= {"head"}
        lost = {e["actor_id"] for e in run_events(run_dir, "actor_lost_with_node")}
        assert lost == set(on_a), (lost, on_a)
        pids_on_a = [a["pid"] for a in status if a["id"] in on_a]
        await until(lambda: not any(alive(pid) for pid in pids_on_a), 30, "no process of node a left running")
        # their registry entries went at once, so the reconciler re-issued what they held (no stage timeout);
        # a reconciler lost with them starts again from the slot table, where the new attempts are issued
        if not any(i.startswith("reconciler-") for i in on_a):
            assert set(on_a) <= {e["actor_id"] for e in run_events(run_dir, "actor_lost")}

        async def finished() -> bool:
            cursor, slots, _ = await _durable_table(run.bus)
            return cursor.position == num_prompts and all(s.state.name == "EMPTY" for s in slots)

        await until(finished, 300, "every prompt trained or dropped")
        await _account(run.bus, ledger, num_prompts, group_size, eta)
        assert not run_events(run_dir, "restart_intensity_exceeded")
        # the trainer read ready groups by reference from the object store (the holder on the head survived)
        reads = run_events(run_dir, "ready_samples_read")
        assert reads and max(r["num_hits"] for r in reads) > 0, reads[-3:]
        print(f"object store reads: {max(r['num_hits'] for r in reads)} hits, "
              f"{max(r['num_misses'] for r in reads)} read from the blob store")
    finally:
        assert await run.stop(timeout_s=120) == 0
