"""The environment's latency model: seeded, heavy-tailed, capped, and a wait that blocks no loop and ends on cancel."""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import pytest

from actors.config import LatencySection, TasksSection
from sandbox.latency import LatencyModel

ON = LatencySection(distribution="lognormal")  # the default heavy tail, switched on


def test_off_by_default_and_waits_nothing() -> None:
    latency = TasksSection().latency
    assert latency.distribution == "off"
    assert latency.tool().draw("tool/e0-p0-s0/a0/0") == 0.0 and latency.test().quantile(0.99) == 0.0
    assert asyncio.run(latency.tool().wait("k")) == 0.0


def test_a_delay_is_a_function_of_seed_and_key_alone() -> None:
    model = ON.tool()
    keys = [f"tool/e0-p{i}-s{j}/a0/0" for i in range(20) for j in range(4)]
    forward = [model.draw(k) for k in keys]
    backward = [model.draw(k) for k in reversed(keys)][::-1]
    assert forward == backward  # the order of the waits does not matter
    assert len(set(forward)) == len(keys)
    other_seed = LatencyModel("lognormal", ON.tool_median_s, ON.sigma, ON.max_s, seed=1)
    assert [other_seed.draw(k) for k in keys] != forward


def test_the_default_heavy_tail_p99_is_at_least_20x_the_median() -> None:
    for model in (ON.tool(), ON.test()):
        assert 20 <= model.quantile(0.99) / model.quantile(0.5) <= 50
        assert model.quantile(0.5) == pytest.approx(model.median_s)
        draws = sorted(model.draw(f"k{i}") for i in range(20_000))
        median, p99 = statistics.median(draws), draws[int(0.99 * len(draws))]
        assert median == pytest.approx(model.median_s, rel=0.05)
        assert 20 <= p99 / median <= 50, (median, p99)
        assert max(draws) <= model.max_s
        # lognormal: the log of the delays has the model's sigma
        assert statistics.stdev(math.log(d) for d in draws if d < model.max_s) == pytest.approx(ON.sigma, rel=0.05)


def test_the_cap_bounds_every_delay() -> None:
    model = LatencyModel("lognormal", median_s=1.0, sigma=3.0, max_s=5.0)
    assert max(model.draw(f"k{i}") for i in range(2000)) == 5.0
    assert model.quantile(0.999) == 5.0


@pytest.mark.parametrize("bad", [
    {"distribution": "pareto"}, {"median_s": -1.0}, {"sigma": float("nan")}, {"median_s": 10.0, "max_s": 5.0},
])
def test_a_bad_model_is_refused_naming_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad)) if "max_s" not in bad else "max_s"):
        LatencyModel(**{"distribution": "lognormal", **bad})


def test_a_bad_section_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"tasks\.latency\.distribution"):
        LatencySection(distribution="uniform")
    with pytest.raises(ValueError, match=r"tasks\.latency\.tool_median_s"):
        LatencySection(tool_median_s=200.0, max_s=100.0)


async def test_the_wait_blocks_no_loop_and_ends_at_once_when_cancelled() -> None:
    model = LatencyModel("lognormal", median_s=30.0, sigma=0.0, max_s=60.0)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    started = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        ticker = tg.create_task(tick())
        waiting = tg.create_task(model.wait("k"))
        await asyncio.sleep(0.2)
        waiting.cancel()
        ticker.cancel()
    assert waiting.cancelled() and time.monotonic() - started < 5.0
    assert ticks >= 5  # the loop kept running other tasks during the 30 s delay
