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


def test_no_one_is_judged_while_the_readers_own_renewals_are_missed_and_that_time_is_credited() -> None:
    """A cluster electing the bucket's leader stores no renewal for seconds: everyone's silence, the
    reader's own included, is the registry's, not the actors'."""
    view = RegistryView(witness="reconciler-1")
    for t in (0.0, 3.3):
        view.observe("reconciler-1", entry("reconciler", "running"), now=t)
        view.observe("rollout-1", entry("rollout", "running"), now=t)
    view.observe("rollout-dead", entry("rollout", "running"), now=3.3)  # renews no more after this
    # no renewal of anyone stored from 3.3 to 14.0: past every lease, but the witness is overdue too
    assert view.expire(now=14.0) == []
    view.observe("reconciler-1", entry("reconciler", "running"), now=14.0)  # the registry is back
    assert view.expire(now=14.1) == [], "7.4 s of the gap (14.0 - 3.3 - 3.3) credited to every lease"
    view.observe("rollout-1", entry("rollout", "running"), now=15.0)  # its own next renewal
    view.observe("reconciler-1", entry("reconciler", "running"), now=17.3)
    view.observe("reconciler-1", entry("reconciler", "running"), now=20.6)
    # 3.3 + 7.4 + 10 = 20.7: the dead one's credited lease ran out, but the registry was last seen live at 20.6
    assert view.expire(now=20.8) == []
    view.observe("reconciler-1", entry("reconciler", "running"), now=23.9)
    (lost,) = view.expire(now=23.95)
    assert lost.actor_id == "rollout-dead"
    assert view.num_running("rollout") == 1


def test_an_entry_the_bus_expired_across_the_readers_gap_is_judged_by_its_credited_lease() -> None:
    view = RegistryView(witness="reconciler-1")
    view.observe("reconciler-1", entry("reconciler", "running"), now=0.0)
    view.observe("rollout-1", entry("rollout", "running"), now=0.0)
    view.observe("reconciler-1", entry("reconciler", "running"), now=12.0)  # 8.7 s of renewals missed
    # the bus's TTL ran out during the election: no loss at once, the actor renews on its next turn
    assert view.observe("rollout-1", None, now=12.1, expired=True) is None
    assert view.num_running("rollout") == 1 and view.expire(now=12.2) == []
    view.observe("rollout-1", entry("rollout", "running"), now=13.0)
    view.observe("reconciler-1", entry("reconciler", "running"), now=15.3)
    assert view.expire(now=22.0) == []
    # the same purge with the witness renewing all along is a loss at once, as without a witness
    view.observe("reconciler-1", entry("reconciler", "running"), now=18.6)
    view.observe("reconciler-1", entry("reconciler", "running"), now=21.9)
    view.observe("reconciler-1", entry("reconciler", "running"), now=25.2)
    lost = view.observe("rollout-1", None, now=25.3, expired=True)  # its lease (from 13.0) ran with the witness live
    assert lost is not None and "the bus expired its registry entry" in lost.reason


def test_a_bus_expired_entry_that_never_comes_back_is_lost_when_its_credited_lease_runs_out() -> None:
    view = RegistryView(witness="reconciler-1")
    view.observe("reconciler-1", entry("reconciler", "running"), now=0.0)
    view.observe("rollout-1", entry("rollout", "running"), now=0.0)
    view.observe("reconciler-1", entry("reconciler", "running"), now=12.0)  # credits 8.7 s
    assert view.observe("rollout-1", None, now=12.1, expired=True) is None
    for t in (15.3, 18.6, 21.9):
        view.observe("reconciler-1", entry("reconciler", "running"), now=t)
    (lost,) = view.expire(now=22.0)  # its credited lease ran out at 0 + 8.7 + 10, the witness renewed after
    assert lost.actor_id == "rollout-1" and view.num_running("rollout") == 0
    assert "expired by the bus" in lost.reason, lost.reason
    assert view.observe("rollout-1", None, now=19.0) is None, "the reconciler's delete of it: already reported"


def test_a_purge_that_comes_before_the_readers_own_overdue_renewal_waits_for_it() -> None:
    """After an election the new leader's TTL purges often arrive before the reader's own renewal is stored."""
    view = RegistryView(witness="reconciler-1")
    view.observe("reconciler-1", entry("reconciler", "running"), now=0.0)
    view.observe("rollout-1", entry("rollout", "running"), now=0.0)
    assert view.observe("rollout-1", None, now=11.0, expired=True) is None  # the witness is overdue (by 5 s)
    assert view.expire(now=11.1) == [] and view.num_running("rollout") == 1
    view.observe("reconciler-1", entry("reconciler", "running"), now=11.5)
    view.observe("rollout-1", entry("rollout", "running"), now=12.0)  # alive: it renews on its next turn
    view.observe("reconciler-1", entry("reconciler", "running"), now=14.8)
    assert view.expire(now=15.0) == [] and view.num_running("rollout") == 1


def test_an_actor_is_judged_only_after_the_reader_saw_its_own_renewal_past_that_actors_lease() -> None:
    """Leases of different lengths: a short-lease actor's silence during a gap shorter than the witness's
    overdue bound is still the registry's, unless the witness renewed after the actor's lease ran out."""
    view = RegistryView(witness="reconciler-1")
    view.observe("reconciler-1", entry("reconciler", "running", lease_s=30.0), now=0.0)
    view.observe("reward-1", entry("reward", "running", lease_s=3.0), now=0.0)
    assert view.expire(now=9.0) == [], "the witness (renewing every 10 s) has not looked since"
    view.observe("reconciler-1", entry("reconciler", "running", lease_s=30.0), now=10.0)
    (lost,) = view.expire(now=10.1)
    assert lost.actor_id == "reward-1"


def test_a_purged_entry_without_a_lease_is_lost_at_once() -> None:
    view = RegistryView(witness="reconciler-1")
    view.observe("reconciler-1", entry("reconciler", "running"), now=0.0)
    view.observe("old-writer", entry("rollout", "running", lease_s=None), now=0.0)
    lost = view.observe("old-writer", None, now=11.0, expired=True)  # the witness overdue: no matter, no lease
    assert lost is not None and "the bus expired" in lost.reason


def test_no_entry_is_believed_past_the_run_s_longest_lease() -> None:
    """A forgery: an entry written by hand to last (no lease, or one of 10^9 s, kept by ``Nats-TTL: never``,
    which the bus's max age spares) is held to the run's longest lease (the bucket's max age) and judged
    lost once unrenewed that long; a genuine shorter lease keeps its own length."""
    view = RegistryView(lease_bound_s=30.0)
    view.observe("forged-none", entry("rollout", "running", lease_s=None), now=0.0)
    view.observe("forged-long", entry("rollout", "running", lease_s=1e9), now=0.0)
    view.observe("genuine", entry("rollout", "running", lease_s=10.0), now=0.0)
    assert [x.actor_id for x in view.expire(now=10.5)] == ["genuine"]
    assert view.expire(now=29.0) == [] and view.num_running("rollout") == 2
    lost = view.expire(now=30.5)
    assert sorted(x.actor_id for x in lost) == ["forged-long", "forged-none"]
    assert all("lease 30s" in x.reason for x in lost) and view.num_running("rollout") == 0
