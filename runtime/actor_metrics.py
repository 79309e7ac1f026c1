"""An actor's Prometheus metrics, in the text exposition format, answered on ``ctl.<actor-id>.metrics``.

Actors may run on any machine, behind no port anyone scrapes; so each one answers a metrics request
on the bus, and the run's dashboard (``ops.dashboard``) serves them all on one ``/metrics`` endpoint,
each series labelled with run, kind and actor: one scrape target per run, wherever its actors are.

What an actor exposes is read when it is asked (nothing is counted twice on the hot path):
- every actor: messages handled, failed, dead-lettered, refused config changes (counters), in flight,
  uptime and its state (gauges);
- the figures of its ``status()`` (each kind's own: the reconciler's slot table and stage latencies, the
  trainer's version and last step...), by one rule: a number (a boolean as 0/1) is a gauge named
  ``asyncrl_<kind>_<path>``; a ``num_*`` number and anything under a ``counters`` mapping is a counter
  (``..._total``); a mapping of numbers under one name becomes one family with its keys as a label
  (``asyncrl_reconciler_lifecycle_slots_per_state{key="rollout"}``). Strings and lists are not metrics.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "asyncrl"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


class Observable(Protocol):
    """What the collector reads of an actor (runtime.actor.Actor is one)."""

    num_handled: int
    num_failed: int
    num_dead_lettered: int
    num_refused_senders: int
    num_rejected_config: int

    @property
    def inflight(self) -> int: ...

    @property
    def uptime_s(self) -> float: ...

    @property
    def state_name(self) -> str: ...

    @property
    def kind_name(self) -> str: ...

    def status(self) -> dict[str, Any]: ...


def metric_name(*parts: str) -> str:
    return _INVALID.sub("_", "_".join(p for p in (PREFIX, *parts) if p))


class ActorCollector(Collector):
    """Reads an actor's figures at scrape time into metric families."""

    STATES = ("created", "starting", "standby", "running", "draining", "stopped")

    def __init__(self, actor: Observable) -> None:
        self._actor = actor

    def collect(self) -> Iterator[Metric]:
        a = self._actor
        for name, doc, value in (
            ("messages_handled", "Messages handled successfully (acknowledged).", a.num_handled),
            ("messages_failed", "Handler failures (the message was redelivered or dead-lettered).", a.num_failed),
            ("messages_dead_lettered", "Messages set aside in the dead-letter stream.", a.num_dead_lettered),
            ("messages_refused", "Messages refused as not their subject's role's to send.", a.num_refused_senders),
            ("config_changes_refused", "Live configuration values this actor refused.", a.num_rejected_config),
        ):
            yield CounterMetricFamily(metric_name("actor", name), doc, value=value)
        yield GaugeMetricFamily(metric_name("actor", "inflight"), "Messages being handled now.", value=a.inflight)
        yield GaugeMetricFamily(metric_name("actor", "uptime_seconds"), "Seconds since the actor started.",
                                value=a.uptime_s)
        state = GaugeMetricFamily(metric_name("actor", "state"), "1 for the actor's lifecycle state.",
                                  labels=["state"])
        for s in self.STATES:
            state.add_metric([s], 1.0 if a.state_name == s else 0.0)
        yield state
        yield from status_families(a.kind_name, a.status())


def status_families(kind: str, status: Mapping[str, Any]) -> Iterator[Metric]:
    """Metric families of a ``status()`` dict, by the rule in the module docstring."""
    yield from _walk((kind,), status, counters=False)


def _walk(path: tuple[str, ...], values: Mapping[str, Any], counters: bool) -> Iterator[Metric]:
    for key, value in values.items():
        here = (*path, str(key))
        as_counter = counters or str(key).startswith("num_")
        if _is_number(value):
            yield _family(here, as_counter, [((), float(value))])
        elif isinstance(value, Mapping) and value and all(_is_number(v) for v in value.values()):
            yield _family(here, as_counter or key == "counters",
                          [((str(k),), float(v)) for k, v in value.items()], label="key")
        elif isinstance(value, Mapping):
            yield from _walk(here, value, counters=as_counter or key == "counters")


def _family(path: tuple[str, ...], counter: bool, samples: list[tuple[tuple[str, ...], float]],
            label: str | None = None) -> Metric:
    name = metric_name(*path)
    doc = f"{'.'.join(path[1:])} of the {path[0]} actor's status"
    labels = [label] if label else []
    family: Metric = (CounterMetricFamily(name, doc, labels=labels) if counter
                      else GaugeMetricFamily(name, doc, labels=labels))
    for label_values, value in samples:
        family.add_metric(list(label_values), value)
    return family


def _is_number(value: Any) -> bool:
    """ints, finite floats, and booleans (as 0/1: ``finished``); a NaN gauge would hide, not say, the fault"""
    return isinstance(value, int | float) and math.isfinite(value)


def exposition(actor: Observable) -> bytes:
    """The actor's metrics in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ActorCollector(actor))
    return generate_latest(registry)
