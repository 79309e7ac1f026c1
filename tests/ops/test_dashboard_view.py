"""The dashboard's view of a run (a pure fold of events and status samples) and its HTTP side, without a run."""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp.test_utils import TestClient, TestServer

from ops.dashboard.model import Limits, RunView
from ops.dashboard.server import build_app
from runtime.errors import ConfigError


def _train(version: int, **extra: float) -> dict:
    return {"event": "train_step", "level": "info", "kind": "trainer", "version": version, "reward_mean": 0.5,
            "loss": 0.1, "lag_histogram": {"0": 3}, **extra}


def test_events_fold_into_curves_and_history_is_bounded() -> None:
    view = RunView("r", Limits(train_rows=3, events=4))
    for v in range(1, 6):
        view.add_event(_train(v))
    view.add_event({"event": "heldout_evaluated", "level": "info", "version": 5, "pass_at_1": 0.25})
    snap = view.snapshot()
    assert [r["version"] for r in snap["train"]] == [3, 4, 5], "oldest rows dropped first"
    assert "lag_histogram" not in snap["train"][0], "only the plotted fields are kept per row"
    assert snap["eval"] == [{"version": 5, "pass_at_1": 0.25}]
    assert len(snap["events"]) == 4 and snap["event_counts"] == {"info": 6}, "counts cover the whole run"


def test_status_samples_chart_the_slot_table() -> None:
    view = RunView("r")
    status = {"actors": [], "reconciler": {"lifecycle": {"slots_per_state": {"empty": 4, "rollout": 2}}}}
    view.set_status(status, now=10.0)
    view.set_status({"actors": []}, now=11.0)  # the reconciler did not answer: no point, status still shown
    assert view.snapshot()["slots"] == [{"time": 10.0, "empty": 4, "rollout": 2}]
    assert view.snapshot()["status"] == {"actors": []}


def test_health_events_give_each_actor_its_health_and_restarts() -> None:
    view = RunView("r", Limits(actors=3))
    sub = view.subscribe()
    ev = [
        {"event": "health_check_failed", "actor_id": "rollout-a", "check": "liveness", "error": "no answer"},
        {"event": "health_check_recovered", "actor_id": "rollout-a", "check": "liveness"},
        {"event": "health_check_failed", "actor_id": "rollout-a", "check": "readiness", "error": "engine dead"},
        {"event": "actor_unhealthy", "actor_id": "rollout-a", "check": "readiness", "reason": "2 checks failed"},
        {"event": "actor_replaced", "old_id": "rollout-a", "new_id": "rollout-b", "check": "readiness"},
        {"event": "actor_crashed", "actor_id": "rollout-b", "returncode": -9},
        {"event": "standby_promoted", "actor_id": "rollout-c", "replaces": "rollout-b"},
        {"event": "actor_replaced", "old_id": "rollout-b", "new_id": "rollout-c"},  # said after the promotion
        {"event": "actor_started", "actor_id": "rollout-c"},  # not a health event: nothing changes
    ]
    for e in ev:
        view.add_event({"level": "info", **e})
    health = view.snapshot()["actor_health"]
    assert health["rollout-a"]["health"] == "unhealthy" and health["rollout-a"]["checks_failed"] == 2
    assert "engine dead" not in health["rollout-a"]["last_failure"], "the verdict, not the last check, is shown"
    assert health["rollout-b"] == {"health": "crashed", "checks_failed": 0, "last_failure": "exit -9",
                                   "restarts": 1, "replaces": "rollout-a"}
    assert health["rollout-c"]["restarts"] == 2 and health["rollout-c"]["health"] == "ok"
    updates = [u["data"] for u in _drain(sub) if u["kind"] == "actor_health"]
    assert updates[0] == {"id": "rollout-a", "health": "failing", "checks_failed": 1,
                          "last_failure": "liveness: no answer", "restarts": 0, "replaces": ""}
    assert updates[1]["health"] == "ok", "a check that passes again clears the failing mark"
    for n in range(5):  # bounded: the oldest actors are forgotten
        view.add_event({"event": "actor_crashed", "actor_id": f"x{n}", "returncode": 1})
    assert list(view.snapshot()["actor_health"]) == ["x2", "x3", "x4"]


def _drain(sub) -> list[dict]:
    out = []
    while not sub.queue.empty():
        out.append(sub.queue.get_nowait())
    return out


def test_a_subscriber_gets_every_update_in_order_and_a_slow_one_is_cut_off() -> None:
    view = RunView("r", Limits(subscriber_queue=2))
    fast, slow = view.subscribe(), view.subscribe()
    view.add_event({"event": "x", "level": "info"})
    got = fast.queue.get_nowait()
    assert got["kind"] == "event" and got["seq"] == 1
    view.add_event({"event": "y", "level": "info"})
    view.add_event({"event": "z", "level": "info"})
    assert [fast.queue.get_nowait()["seq"] for _ in range(2)] == [2, 3]
    assert slow.overflowed.is_set(), "three updates into a queue of two: cut off, not buffered without bound"
    view.unsubscribe(slow)
    assert view.num_subscribers == 1


async def _client(view: RunView, setter=None) -> TestClient:  # type: ignore[no-untyped-def]
    client = TestClient(TestServer(build_app(view, setter)))
    await client.start_server()
    return client


async def test_snapshot_is_json_even_with_non_finite_figures() -> None:
    view = RunView("r")
    view.add_event(_train(1, loss=math.nan, grad_norm=math.inf))
    client = await _client(view)
    try:
        reply = await client.get("/api/snapshot")
        body = json.loads(await reply.text())  # strict JSON: NaN would not parse in a browser
        assert body["train"][0]["loss"] == "nan" and body["train"][0]["grad_norm"] == "inf"
        assert (await client.get("/healthz")).status == 200
        page = await client.get("/")
        assert page.status == 200 and "uPlot" in await page.text()
        assert (await client.get("/static/vendor/uplot/uPlot.iife.min.js")).status == 200
    finally:
        await client.close()


async def test_the_stream_starts_with_a_snapshot_then_sends_updates() -> None:
    view = RunView("r")
    client = await _client(view)
    try:
        reply = await client.get("/api/stream")
        assert reply.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)
        assert first.startswith(b"event: snapshot\ndata: ")
        view.add_event(_train(1))
        view.add_event(_train(2))
        update = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)
        assert update.startswith(b"event: updates\n")
        kinds = [u["kind"] for u in json.loads(update.split(b"data: ", 1)[1])]
        assert kinds[:2] == ["event", "train"], "a burst goes as one message, in order"
        view.close_subscribers()
        rest = await asyncio.wait_for(reply.content.read(), 5)
        assert rest.endswith(b"event: closing\ndata: {}\n\n"), "a stopping server ends the stream cleanly"
    finally:
        await client.close()


async def test_live_config_goes_through_the_setter_and_refusals_say_why() -> None:
    calls = []

    async def setter(key: str, raw: str) -> object:
        if raw == "bad":
            raise ConfigError(f"{key}: expected a float, got {raw!r}")
        calls.append((key, raw))
        return float(raw)

    client = await _client(RunView("r"), setter)
    try:
        ok = await client.post("/api/config", json={"key": "reward.length_coef", "value": "0.5"})
        assert ok.status == 200 and (await ok.json())["value"] == 0.5 and calls == [("reward.length_coef", "0.5")]
        refused = await client.post("/api/config", json={"key": "reward.length_coef", "value": "bad"})
        assert refused.status == 400 and "expected a float" in (await refused.json())["error"]
        malformed = await client.post("/api/config", data=b"not json")
        assert malformed.status == 400
    finally:
        await client.close()
    offline = await _client(RunView("r"), None)
    try:
        assert (await offline.post("/api/config", json={"key": "a", "value": "1"})).status == 409
    finally:
        await offline.close()
