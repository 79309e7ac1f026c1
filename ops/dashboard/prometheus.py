"""One Prometheus scrape target for a whole run: every live actor's metrics, labelled run, run_name, kind, actor.

``run`` is the run's id (runtime.run_state: unique, stable across resumes), so that two runs scraped into one
Prometheus never share a series; ``run_name`` is its configured name (``run.name``, "default" unless set), which
runs share.

A scrape asks each registered actor for its metrics on the bus (``ctl.<kind>.<id>.metrics``, all at once, each
within a deadline), adds the labels, merges the families and answers in the text format. An actor that
does not answer in time is said so by ``asyncrl_scrape_up{kind,actor} 0`` (as Prometheus's own ``up``),
never by a scrape that hangs or fails whole.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ops import status as ops_status
from ops._client import request
from runtime.bus import Bus
from runtime.bus_auth import control_subject
from runtime.errors import BusError

# The families every live run has (README, "Operating a run"): each actor's own, and by kind from its status
DOCUMENTED = {
    "asyncrl_scrape_up": "every actor: 1 if it answered the scrape in time",
    "asyncrl_actor_messages_handled": "every actor: messages handled (counter)",
    "asyncrl_actor_messages_failed": "every actor: handler failures (counter)",
    "asyncrl_actor_messages_dead_lettered": "every actor: messages dead-lettered (counter)",
    "asyncrl_actor_config_changes_refused": "every actor: live values refused (counter)",
    "asyncrl_actor_inflight": "every actor: messages in hand",
    "asyncrl_actor_uptime_seconds": "every actor: seconds since start",
    "asyncrl_actor_state": "every actor: 1 for its lifecycle state (label state)",
    "asyncrl_reconciler_trainer_version": "the policy version the reconciler knows",
    "asyncrl_reconciler_lifecycle_slots_per_state": "slots per state (label key)",
    "asyncrl_reconciler_lifecycle_counters": "trained samples, retries, drops... (counter, label key)",
    "asyncrl_reconciler_lifecycle_samples_per_s": "trained samples per second",
    "asyncrl_reconciler_lifecycle_lag_histogram": "trained samples per lag (label key)",
    "asyncrl_trainer_version": "the trainer's policy version",
}
LABELS = ("run", "run_name", "kind", "actor")  # on every series: the run's id and name, the actor's kind and id
SCRAPE_TIMEOUT_S = 2.0
# requests to actors at once: a run of 10^3 actors is scraped in waves, not by 10^3 requests (and their
# replies) landing on the bus and on this process together
MAX_REQUESTS_IN_FLIGHT = 64
CONTENT_TYPE = CONTENT_TYPE_LATEST


async def _actor_metrics(bus: Bus, kind: str, actor_id: str, timeout_s: float) -> str | None:
    try:
        body = await request(bus, control_subject(kind, actor_id, "metrics"), timeout_s=timeout_s)
    except (BusError, ValueError):  # no answer in time, or not msgpack: either way, not scraped
        return None
    text = body.get("text") if isinstance(body, dict) and body.get("ok") else None
    return text if isinstance(text, str) else None


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


async def scrape(bus: Bus, run_id: str, run_name: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> bytes:
    """Every registered, running actor's metrics, merged, in the Prometheus text format, labelled ``run`` (the
    run's id) and ``run_name``."""
    actors, _ = await ops_status.registered(bus)
    actors = [a for a in actors if a.get("state") in ("running", "draining")]
    in_flight = asyncio.Semaphore(MAX_REQUESTS_IN_FLIGHT)

    async def bounded(actor: dict) -> str | None:
        async with in_flight:
            return await _actor_metrics(bus, actor["kind"], actor["id"], timeout_s)

    texts = await asyncio.gather(*(bounded(a) for a in actors))
    merged: dict[str, Metric] = {}
    up = GaugeMetricFamily("asyncrl_scrape_up", "1 if the actor answered this scrape in time, else 0.",
                           labels=list(LABELS))
    for actor, text in zip(actors, texts, strict=True):
        labels = dict(zip(LABELS, (run_id, run_name, actor["kind"], actor["id"]), strict=True))
        up.add_metric(list(labels.values()), 0.0 if text is None else 1.0)
        for family in text_string_to_metric_families(text or ""):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                into.add_sample(sample.name, {**labels, **sample.labels}, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([up, *merged.values()]))
    return generate_latest(registry)
