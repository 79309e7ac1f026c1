"""The dashboard of a run whose policy is pretrained, built once for the run (`runtime.build_once`) by another
process on another machine: the dashboard never builds it, never waits for it in its start, and its rollout
viewer decodes the run's samples with the build's tokenizer once the run has stored it, fetching only the
tokenizer's files into its own machine's cache.

A real run (``runtime.up``, its nats-server and ``file://`` store) of the dashboard and an idle grouping; this
test is the builder, on the run's bus and store, with a small real checkpoint (the tiny policy's weights, a
byte-level BPE tokenizer.json) under the build name of ``policy.pretrained``'s recipe: the build's name is all
the dashboard goes by, so the 98 MB pinned download is not needed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from actors.pretrained_policy import CARD, PretrainedRecipe
from model.checkpoint import save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from runtime.blob import open_store
from runtime.build_once import BuildSettings, build_once
from tests.actors.agent.test_dialect import PLAIN_TEMPLATE, _checkpoint
from tests.actors.test_sample_views import tokenized_group_record
from tests.integration.harness import LiveRun, run_events, write_config
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)

RECIPE = PretrainedRecipe("smollm2-135m-instruct", experts=4, top_k=2)
PROMPT, ANSWER = "User: hi\nAssistant:", " done</s>"
RUN = """
[run]
name = "viewer"
config_schema = "actors.config:RLConfig"

[dashboard]
port = 0
sample_views = "actors.sample_views:run_sample_views"

[actors.dashboard]
entry = "ops.dashboard.actor:DashboardActor"
count = 1

[actors.grouping]  # an actor of the RL trainer, whose configuration the run's sections are (it needs no policy)
entry = "actors.stages.grouping:GroupingActor"
count = 1

[policy]
pretrained = "{pretrained}"
upcycle_experts = {experts}
upcycle_top_k = {top_k}
cache_dir = "{cache_dir}"
"""


def _run_file(tmp_path: Path, cache_dir: Path) -> Path:
    return write_config(tmp_path / "run.toml", RUN.format(pretrained=RECIPE.name, experts=RECIPE.experts,
                                                          top_k=RECIPE.top_k, cache_dir=cache_dir))


class SmallBuild:
    """The recipe's build as `actors.pretrained_policy.build_pretrained` lays it out (weights, config, tokenizer,
    the card last), small; held until ``release`` is set (a build that takes its time)."""

    def __init__(self, held: bool = False) -> None:
        self.release = threading.Event()
        if not held:
            self.release.set()

    def __call__(self, out: Path) -> None:
        if not self.release.wait(120):
            raise TimeoutError("the test never released the build")
        save_checkpoint(MoETransformer(tiny()).init_weights(0), out)
        _checkpoint(out, PLAIN_TEMPLATE)
        (out / CARD).write_text(json.dumps(dataclasses.asdict(RECIPE)))


async def _store_group(run: LiveRun, store: Any, tokenizer_dir: Path) -> None:
    """A group record in the run's store, and the event that names it on the run's log (as grouping does)."""
    assert run.bus is not None
    await store.put("groups/e0-p0/a0", tokenized_group_record(tokenizer_dir, PROMPT, ANSWER, "e0-p0"))
    event = {"event": "group_checkpointed", "key": "groups/e0-p0/a0", "group_id": "e0-p0", "level": "info",
             "actor": "grouping-1-test", "timestamp": datetime.now(UTC).isoformat()}
    await run.bus.publish("log.grouping.info", json.dumps(event).encode())


def _samples(url: str, path: str = "api/samples") -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as reply:
        return json.loads(reply.read())


async def _decoded_sample(url: str) -> list[str]:
    async def shown() -> list[str] | None:
        body = await asyncio.to_thread(_samples, url)
        if not body["samples"]:
            return None
        whole = await asyncio.to_thread(_samples, url, f"api/samples/{body['samples'][0]['sample_id']}")
        return [run[0] for run in whole["tokens"]]

    return await until(shown, 60, "the sample decoded on the page")


def _fetched_files(cache_dir: Path) -> set[str]:
    return {p.relative_to(cache_dir).as_posix().split("/", 1)[1] for p in cache_dir.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


async def test_a_dashboard_started_before_the_build_stays_up_and_shows_views_after_it(tmp_path: Path) -> None:
    build = SmallBuild(held=True)
    dashboard_cache = tmp_path / "dashboard-machine"
    run = await LiveRun(tmp_path / "run", _run_file(tmp_path, dashboard_cache)).start()
    try:
        assert run.bus is not None and run.info is not None
        async with open_store(run.info.storage_url) as store:
            settings = BuildSettings(lease_s=2.0, timeout_s=180.0)
            building = asyncio.create_task(build_once(run.bus, store, RECIPE.build_name(), build,
                                                      tmp_path / "builder-machine", owner="builder", settings=settings))
            (entry,) = await run.wait_actors("dashboard", 1, timeout_s=120)  # up while the build goes on
            url = entry["url"]
            await _store_group(run, store, _checkpoint(tmp_path / "tokenizer", PLAIN_TEMPLATE))
            async def waiting_note() -> dict[str, Any] | None:
                body = await asyncio.to_thread(_samples, url)
                return body if "waiting for the run's policy build" in body.get("note", "") else None

            body = await until(waiting_note, 30, "the page to say the viewer waits for the build")
            assert body["samples"] == []
            await until(lambda: run_events(run.run_dir, "dashboard_viewer_waiting"), 30, "the viewer says it waits")
            assert not building.done()

            build.release.set()
            await asyncio.wait_for(building, 60)
            assert await _decoded_sample(url) == [PROMPT, ANSWER]
            assert "note" not in await asyncio.to_thread(_samples, url)
            (ready,) = await until(lambda: run_events(run.run_dir, "dashboard_viewer_ready"), 30, "the viewer ready")
            assert ready["num_skipped"] == 0, "the group noticed while it waited is kept"
        (same,) = await run.wait_actors("dashboard", 1)
        assert same["id"] == entry["id"] and not run_events(run.run_dir, "actor_crashed"), "never restarted"
        assert _fetched_files(dashboard_cache) == {"tokenizer.json", "tokenizer_config.json"}, "the tokenizer only"
    finally:
        build.release.set()
        await run.stop()


async def test_a_dashboard_on_a_machine_with_an_empty_cache_fetches_the_tokenizer_from_the_store(
        tmp_path: Path) -> None:
    dashboard_cache = tmp_path / "dashboard-machine"
    run = await LiveRun(tmp_path / "run", _run_file(tmp_path, dashboard_cache)).start()
    try:
        assert run.bus is not None and run.info is not None
        async with open_store(run.info.storage_url) as store:
            built = await build_once(run.bus, store, RECIPE.build_name(), SmallBuild(), tmp_path / "builder-machine",
                                     owner="builder")
            assert not dashboard_cache.exists() or not any(dashboard_cache.iterdir())
            (entry,) = await run.wait_actors("dashboard", 1, timeout_s=120)
            await _store_group(run, store, built)
            assert await _decoded_sample(entry["url"]) == [PROMPT, ANSWER]
        assert _fetched_files(dashboard_cache) == {"tokenizer.json", "tokenizer_config.json"}, "the tokenizer only"
        assert not run_events(run.run_dir, "actor_crashed")
    finally:
        await run.stop()
