"""tests.bench.scale at tiny sizes: the reconciler's table on a three-server cluster (one size past the 1,024 keys
one bulk read of the store takes), simulated actors' leases and a Prometheus scrape of them, and its JSON line."""

from __future__ import annotations

import json

import pytest

from tests.bench import scale

pytestmark = [pytest.mark.timeout(300)]  # about 15 s on 2 busy cores


def test_the_bench_measures_the_table_and_the_registry_at_tiny_sizes() -> None:
    result = scale.main(["--slots", "96,1536", "--actors", "30", "--tables", "1", "--lease-s", "3",
                         "--window-s", "2"])
    json.dumps(result)  # the line it prints
    small, large = result["slots"]
    for size, trial in ((96, small), (1536, large)):
        assert trial["slots"] == size and trial["trained_samples_measured"] >= size
        assert trial["live_slots_at_stop"] > size // 2  # the table in flight when it is resumed
        assert trial["lifecycles_per_s"] > 0 and trial["cpu_ms_per_lifecycle"]["reconciler"] > 0
        assert 0 < trial["resume_s"] < 60 and trial["memory_bytes_per_slot"] > 0
        assert trial["bucket_messages"] >= size and trial["bucket_bytes_per_slot"] > 0
    (actors,) = result["actors"]
    assert actors["actors"] == 30 and actors["running_seen"] == 30 and actors["wrongly_lost"] == 0
    assert actors["renewals_per_s"] > 0 and actors["scrape_actors_up"] == 30 and actors["scrape_s"] > 0
    # the bounds themselves (renewals at their rate, the scrape's time) are for a quiet machine: reported here
    assert isinstance(actors["leases_within_bounds"], bool) and isinstance(actors["scrape_within_bound"], bool)
