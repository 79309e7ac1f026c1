"""The lifecycle bench's Ray peer is fair: it calls each stage once per group (a batch per train call), as
verl sends its workers batches, and its CPU is counted as the NATS side's is, over every process of the side."""

from __future__ import annotations

import argparse
import time

import pytest

from tests.bench.lifecycle import CpuSampler, ray_trial, start_ray

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.xdist_group("lifecycle_bench_ray")]  # one worker: one Ray instance


@pytest.fixture(scope="module")
def ray_actors():
    import ray

    actors = start_ray()
    try:
        yield actors
    finally:
        ray.shutdown()


async def test_ray_peer_calls_each_stage_once_per_group_and_counts_every_ray_process(ray_actors) -> None:
    args = argparse.Namespace(prompts=48, group_size=4, batch_groups=8, slots=64, eta=1)
    calls: dict[str, int] = {}
    result = await ray_trial(args, ray_actors, calls_out=calls)
    assert calls == {"rollout": 48, "reward": 48, "group": 48, "train": 6}
    assert result["trained_samples"] == 48 * 4
    cpu = result["cpu_ms_per_lifecycle"]
    # the driver (the controller loop) and Ray's own processes, each named: nothing of the side left out
    assert {"driver", "gcs", "raylet", "workers", "ray_other", "total"} <= set(cpu)
    assert cpu["workers"] > 0 and cpu["driver"] > 0


def test_cpu_window_is_the_samples_nearest_outside_the_trained_span() -> None:
    sampler = CpuSampler(lambda: {})
    sampler.samples = [(0.0, {"a": 0.0}), (1.0, {"a": 1.0}), (2.0, {"a": 3.0}), (3.0, {"a": 6.0}), (4.0, {"a": 10.0})]
    batches = [(1.5, 10), (2.5, 10), (2.9, 10)]  # the first batch's samples count: the window opens before it
    cpu = sampler.per_lifecycle(batches)
    assert cpu == {"a": pytest.approx(1e3 * (6.0 - 1.0) / 30), "total": pytest.approx(1e3 * 5.0 / 30)}


def test_the_sampler_does_not_count_its_own_cpu_in_the_process_it_measures() -> None:
    def busy_reading() -> dict[str, float]:
        end = time.thread_time() + 0.005  # a costly read: scanning /proc for a process tree
        while time.thread_time() < end:
            pass
        return {"driver": time.process_time()}

    with CpuSampler(busy_reading, interval_s=0.01, own_role="driver") as sampler:
        time.sleep(0.3)  # the measured process itself idles
    first, last = sampler.samples[0][1]["driver"], sampler.samples[-1][1]["driver"]
    assert len(sampler.samples) >= 10
    assert last - first < 0.02  # without the subtraction: >= 10 reads x 5 ms
