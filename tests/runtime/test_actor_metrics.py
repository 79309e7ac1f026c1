"""An actor's Prometheus exposition: the base figures and its status() by the documented rule."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runtime.actor_metrics import exposition


class _Actor:
    num_handled, num_failed, num_dead_lettered, num_refused_senders, num_rejected_config = 7, 1, 0, 0, 2
    inflight, uptime_s, state_name, kind_name = 3, 12.5, "running", "reconciler"

    def status(self) -> dict[str, Any]:
        return {"trainer_version": 4, "finished": False, "name": "not a metric", "lag": [1, 2],
                "num_rejected_registrations": 5, "loss": float("nan"),
                "lifecycle": {"slots_per_state": {"empty": 10, "rollout": 6},
                              "counters": {"trained_samples": 96, "retries": 1},
                              "stage_latency": {"rollout": {"p50_s": 0.2, "p99_s": 0.9, "count": 40}}}}


def _parse(actor: Any) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(exposition(actor).decode())}


def test_every_actor_has_the_base_figures() -> None:
    families = _parse(_Actor())
    assert families["asyncrl_actor_messages_handled"].type == "counter"
    assert families["asyncrl_actor_messages_handled"].samples[0].value == 7
    assert families["asyncrl_actor_inflight"].samples[0].value == 3
    states = {s.labels["state"]: s.value for s in families["asyncrl_actor_state"].samples}
    assert states["running"] == 1 and sum(states.values()) == 1


def test_status_numbers_become_gauges_counters_and_labelled_families() -> None:
    families = _parse(_Actor())
    assert families["asyncrl_reconciler_trainer_version"].type == "gauge"
    assert families["asyncrl_reconciler_finished"].samples[0].value == 0, "a boolean is a 0/1 gauge"
    assert families["asyncrl_reconciler_num_rejected_registrations"].type == "counter"
    slots = families["asyncrl_reconciler_lifecycle_slots_per_state"]
    assert {s.labels["key"]: s.value for s in slots.samples} == {"empty": 10, "rollout": 6}
    counters = families["asyncrl_reconciler_lifecycle_counters"]
    assert counters.type == "counter" and {s.name for s in counters.samples} == {
        "asyncrl_reconciler_lifecycle_counters_total"}
    latency = families["asyncrl_reconciler_lifecycle_stage_latency_rollout"]
    assert {s.labels["key"]: s.value for s in latency.samples}["p99_s"] == 0.9
    assert not any("name" in n or n.endswith("_lag") or n.endswith("_loss") for n in families), \
        "strings, lists and non-finite numbers are not metrics"
