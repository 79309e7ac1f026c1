"""The short end-to-end run (tests/integration/test_e2e.py's: the real reconciler, rollout, reward, grouping,
trainer, evaluator and dashboard, sandboxed rewards, delta weight sync) on a Ray cluster of three nodes on
this machine and a NATS JetStream cluster of three servers on loopback, started as a user starts it::

    python -m actors --preset short --steps 3 --config PLACEMENT.toml --set runtime.backend="ray" \\
        --set runtime.ray_address="HEAD:PORT" --set bus.embedded_servers=3

The head carries `control` (the reconciler, grouping, evaluator, dashboard ask for it), one worker
`sandbox` (rollout, reward), the other `trainer` (the trainer): each kind must run on the one node that has
its resource, asserted from the operating system (the node whose raylet the actor process descends from)
and from the supervisor's record of where Ray placed it. The run trains its steps and finishes by itself;
every admitted prompt is trained once or accounted for; the trainer reads its batches from the Ray object
store. The supervisor asks Ray for every actor at once (runtime.supervisor: placements are independent), so
all seven are placed within seconds of each other.

And the chaos of a node lost under the real stages: with two sandbox nodes, the one the rollout actor runs on
is removed (its raylet and workers SIGKILLed) after the first trained step; the actors on it are placed again
on the other, their episodes re-issued (resumed from rollout checkpoints where they have one), and the run
trains every step, every prompt accounted, nothing trained twice.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.integration.harness import LiveRun, run_events, write_config
from tests.integration.test_e2e import _rows, _short_run, _wait_finished, assert_every_prompt_accounted
from tests.integration.test_e2e import starting_policy as starting_policy  # the fixture, shared
from tests.integration.test_ray_backend import HEALTH_CHECKS, _nodes_by_kind, _ray_args, _start_order, ray_cluster_of
from tests.waiting import until

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS = 3
# the held-out evaluations at the start and the end are most of the short run's time on 2 cores: a quarter of
# test_e2e's (4 tasks, 1 sample each), still the real evaluator
SHORTER_EVALUATION = ("--set", "tasks.num_heldout=4", "--set", "eval.samples_per_task=1")
# one custom resource per node, none shared: a kind placed anywhere else would be Ray's error or ours
NODES = {
    "head": {"num_cpus": 2, "resources": {"control": 8}, "_system_config": HEALTH_CHECKS},
    "sandboxes": {"num_cpus": 2, "resources": {"sandbox": 8}, "labels": {"pool": "sandbox"}},
    "trainers": {"num_cpus": 1, "resources": {"trainer": 1}, "labels": {"pool": "trainer"}},
}
RESOURCE_OF_KIND = {"reconciler": "control", "grouping": "control", "evaluator": "control", "dashboard": "control",
                    "rollout": "sandbox", "reward": "sandbox", "trainer": "trainer"}


def _node_with(resource: str) -> str:
    (name,) = [name for name, options in NODES.items() if resource in options["resources"]]
    return name


def _placement_toml() -> str:
    return "".join(f"[actors.{kind}.placement]\nresources = {{{resource} = 1}}\n\n"
                   for kind, resource in RESOURCE_OF_KIND.items())


async def test_the_short_run_on_a_ray_cluster_and_a_nats_cluster(tmp_path: Path, starting_policy: Path) -> None:
    placement = write_config(tmp_path / "placement.toml", _placement_toml())
    configs = [*_short_run(tmp_path, seed=2, steps=STEPS, checkpoint=starting_policy), placement]
    expected = {kind: _node_with(resource) for kind, resource in RESOURCE_OF_KIND.items()}
    with ray_cluster_of(NODES) as cluster:
        launched = time.monotonic()
        run = await LiveRun(tmp_path / "run", configs, *_ray_args(cluster), "--set", "bus.embedded_servers=3",
                            *SHORTER_EVALUATION).start(timeout_s=180)
        try:
            assert run.info is not None and len(run.info.nats_url.split(",")) == 3, run.info
            by_os: dict[str, str] = {}
            for kind in RESOURCE_OF_KIND:  # each kind's registry entry (its own pid), as soon as it runs
                (entry, *_) = await run.wait_actors(kind, 1, timeout_s=300)
                by_os[kind] = cluster.node_of_pid(entry["pid"])
            all_running_s = time.monotonic() - launched
            by_supervisor = {a["kind"]: cluster.name_of(a["node"]) for a in await run.actors()}
            assert by_os == expected, f"where the processes run: {by_os}, asked for {expected}"
            assert by_supervisor == expected, f"where the supervisor says Ray placed them: {by_supervisor}"
            order = _start_order(run.run_dir)  # placed together: every start asked for before any was placed
            assert order[:len(expected) + 1] == ["actor_starting"] * len(expected) + ["actor_spawned"], order
            assert await _wait_finished(run, 600) == 0, run.output()
        finally:
            await run.stop(timeout_s=120)
        print(f"all {len(expected)} kinds running {all_running_s:.1f}s after launch, "
              f"the run finished {time.monotonic() - launched:.1f}s after launch")
    run_dir = run.run_dir
    assert [r["version"] for r in await _rows(run_dir, "train")] == list(range(1, STEPS + 1))
    await assert_every_prompt_accounted(run_dir, steps=STEPS)
    assert not run_events(run_dir, "actor_crashed"), [e.get("error", "")[-300:] for e in run_events(
        run_dir, "actor_crashed")]
    assert not run_events(run_dir, "actor_not_placed")
    # the trainer read its batches by reference from the Ray object store (the grouping actor put them there)
    reads = [r for r in run_events(run_dir, "ready_samples_read") if r["actor"].startswith("trainer-")]
    assert reads and reads[-1]["num_hits"] >= 2 * STEPS and reads[-1]["num_misses"] == 0, reads[-1:]
    placed = run_events(run_dir, "actor_placed")
    assert {p["actor_id"].split("-")[0] for p in placed} == set(RESOURCE_OF_KIND), placed


CHAOS_STEPS = 8  # steps left after the first: the run outlives the replacement's placement and does work
CHAOS_NODES = {
    "head": {"num_cpus": 2, "resources": {"control": 8}, "_system_config": HEALTH_CHECKS},
    "sandboxes-a": {"num_cpus": 1, "resources": {"sandbox": 8}},
    "sandboxes-b": {"num_cpus": 1, "resources": {"sandbox": 8}},
    "trainers": {"num_cpus": 1, "resources": {"trainer": 1}},
}


async def test_a_node_lost_under_the_real_stages_costs_no_prompt(tmp_path: Path, starting_policy: Path) -> None:
    placement = write_config(tmp_path / "placement.toml", _placement_toml())
    configs = [*_short_run(tmp_path, seed=3, steps=CHAOS_STEPS, checkpoint=starting_policy), placement]
    with ray_cluster_of(CHAOS_NODES) as cluster:
        run = await LiveRun(tmp_path / "run", configs, *_ray_args(cluster), *SHORTER_EVALUATION).start(timeout_s=180)
        try:
            (rollout, *_) = await run.wait_actors("rollout", 1, timeout_s=300)
            await run.wait_actors("trainer", 1, timeout_s=300)
            victim = cluster.node_of_pid(rollout["pid"])
            survivor = ({"sandboxes-a", "sandboxes-b"} - {victim}).pop()
            on_victim = sorted(a["id"] for a in await run.actors() if cluster.name_of(a["node"]) == victim)
            await until(lambda: _trained_versions(run), 600, "a first trained step")
            assert max(await _trained_versions(run)) < CHAOS_STEPS, "the run must still be going"
            removed_at = time.monotonic()
            await asyncio.to_thread(cluster.cluster.remove_node, cluster.nodes[victim], False)  # SIGKILL: no goodbye

            async def placed_again() -> dict[str, list[str]] | None:
                nodes = await _nodes_by_kind(run, cluster)
                return nodes if nodes.get("rollout") == [survivor] and nodes.get("reward") == [survivor] else None

            after = await until(placed_again, 300, "the rollout and reward actors placed again on the other node")
            replaced_s = time.monotonic() - removed_at
            assert await _wait_finished(run, 600) == 0, run.output()
        finally:
            await run.stop(timeout_s=120)
    print(f"node {victim} removed with {on_victim}; placed again on {after} within {replaced_s:.1f}s")
    run_dir = run.run_dir
    assert {e["actor_id"] for e in run_events(run_dir, "actor_lost_with_node")} == set(on_victim)
    assert [r["version"] for r in await _rows(run_dir, "train")] == list(range(1, CHAOS_STEPS + 1))
    await assert_every_prompt_accounted(run_dir, steps=CHAOS_STEPS)
    assert not run_events(run_dir, "restart_intensity_exceeded")
    finished_by = {e["actor"] for e in run_events(run_dir, "rollout_finished")}
    assert finished_by - set(on_victim), "the rollout actor placed again finished episodes"
    # what the lost rollout actor held was re-issued at once (its entry removed), not after the 120 s timeout
    reissued = [e for e in run_events(run_dir, "work_retried") if "timed out" in e.get("reason", "")]
    assert not reissued, reissued[:3]


async def _trained_versions(run: LiveRun) -> list[int]:
    return [r["version"] for r in await _rows(run.run_dir, "train")]
