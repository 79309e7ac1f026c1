"""The run's Prometheus scrape (issue 30, item 12): every series is labelled with the run's id as ``run`` (unique),
its name as ``run_name`` (shared: "default" unless set), and the actor's kind and id; so two runs of one name
scraped into one Prometheus never share a series.

`ops.dashboard.prometheus.scrape` over a bus double holding one registered actor (the live run's scrape, every
documented family, is in tests/integration/test_dashboard.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgpack
from prometheus_client.parser import text_string_to_metric_families

from ops.dashboard.prometheus import scrape
from runtime.registry import registration_key

KEY = registration_key("trainer", "trainer-1-ab")
ENTRY = {"kind": "trainer", "id": "trainer-1-ab", "state": "running", "pid": 7, "host": "h", "code_hash": "c",
         "num_inflight": 0, "num_handled": 3, "num_failed": 0, "num_dead_lettered": 0, "uptime_s": 1.0}


class _Bus:
    """The registry holds one running trainer, which answers its metrics request."""

    async def kv_items(self, bucket: str) -> list[Any]:
        return [SimpleNamespace(key=KEY, value=msgpack.packb(ENTRY))]

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        assert subject == "ctl.trainer.trainer-1-ab.metrics", subject
        return msgpack.packb({"ok": True, "text": "# TYPE asyncrl_trainer_version gauge\nasyncrl_trainer_version 4\n"})


async def _series(run_id: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    text = (await scrape(_Bus(), run_id=run_id, run_name="default")).decode()  # type: ignore[arg-type]
    return {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples}


async def test_every_series_carries_the_run_s_id_as_run_and_its_name_as_run_name() -> None:
    series = await _series("20260101-000000-default-abc123")
    assert {name for name, _ in series} == {"asyncrl_scrape_up", "asyncrl_trainer_version"}
    for _, labels in series:
        assert dict(labels) == {"run": "20260101-000000-default-abc123", "run_name": "default", "kind": "trainer",
                                "actor": "trainer-1-ab"}


async def test_two_runs_of_one_name_share_no_series() -> None:
    assert not (await _series("20260101-000000-default-abc123")) & (await _series("20260102-000000-default-def456"))
