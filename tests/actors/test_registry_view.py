"""RegistryView: registry entries as leases; lost actors reported once, for the right reason."""

from __future__ import annotations

import msgpack

from actors.reconciler.registry_view import RegistryView


def entry(kind: str, state: str, lease_s: float | None = 10.0) -> bytes:
    info = {"kind": kind, "state": state, "id": "x"}
    if lease_s is not None:
        info["lease_s"] = lease_s
    return msgpack.packb(info)


def test_a_lease_not_renewed_expires_once_and_a_renewal_revives_it() -> None:
    view = RegistryView()
    assert view.observe("rollout-1", entry("rollout", "running"), now=100.0) is None
    assert view.observe("rollout-2", entry("rollout", "running"), now=100.0) is None
    assert view.num_running("rollout") == 2
    assert view.expire(now=109.0) == []
    view.observe("rollout-2", entry("rollout", "running"), now=108.0)  # renewed
    (lost,) = view.expire(now=110.5)
    assert (lost.actor_id, lost.kind) == ("rollout-1", "rollout") and "no lease renewal for 10.5s" in lost.reason
    assert [x.actor_id for x in view.expire(now=200.0)] == ["rollout-2"]  # its lease ran out at 118
    assert view.num_running("rollout") == 0
    view.observe("rollout-1", entry("rollout", "running"), now=201.0)  # it was only paused: alive again
    assert view.num_running("rollout") == 1 and view.expire(now=205.0) == []


def test_each_loss_is_reported_once() -> None:
    view = RegistryView()
    view.observe("a", entry("reward", "running", lease_s=1.0), now=0.0)
    assert [x.actor_id for x in view.expire(now=2.0)] == ["a"]
    assert view.expire(now=3.0) == [] and view.observe("a", None, now=4.0) is None  # its removal: already lost


def test_a_removed_entry_is_lost_unless_it_said_stopped() -> None:
    view = RegistryView()
    for key, state in (("crashed", "running"), ("killed-draining", "draining"), ("clean", "stopped")):
        view.observe(key, entry("rollout", "running"), now=0.0)
        view.observe(key, entry("rollout", state), now=1.0)
    lost = {key: view.observe(key, None, now=2.0) for key in ("crashed", "killed-draining", "clean")}
    assert lost["clean"] is None
    assert "removed while running" in lost["crashed"].reason
    assert "removed while draining" in lost["killed-draining"].reason
    assert view.observe("never-seen", None, now=3.0) is None


def test_a_stopped_actor_or_an_entry_without_lease_never_expires_and_other_records_are_ignored() -> None:
    view = RegistryView()
    view.observe("stopped", entry("rollout", "stopped"), now=0.0)
    view.observe("old-writer", entry("rollout", "running", lease_s=None), now=0.0)
    view.observe("handover.rollout", msgpack.packb({"cursor": 3}), now=0.0)
    view.observe("garbage", b"\xc1", now=0.0)
    assert view.expire(now=1e6) == []
    assert view.num_running("rollout") == 1


def test_an_entry_the_bus_expired_is_lost_for_its_lease_once_and_a_stopped_one_is_not() -> None:
    view = RegistryView()
    view.observe("rollout-1", entry("rollout", "running"), now=0.0)
    view.observe("rollout-2", entry("rollout", "stopped"), now=0.0)
    lost = view.observe("rollout-1", None, now=9.5, expired=True)  # the bus's TTL, before the reader's bound
    assert lost is not None and lost.reason == "no lease renewal for 9.5s: the bus expired its registry entry"
    assert view.observe("rollout-2", None, now=9.5, expired=True) is None  # it had stopped cleanly
    assert view.expire(now=100.0) == [] and view.num_running("rollout") == 0
