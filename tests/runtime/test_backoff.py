"""Every exponential backoff of the project holds for any count: ``base * 2 ** n`` raised OverflowError
from n = 1024, which a retry loop bounded by time (the full-disk wait) or a large configured count reaches."""

from __future__ import annotations

import random

import pytest
from structlog.testing import capture_logs

from model.weight_sync.store import Retry
from runtime.actor import ActorSettings
from runtime.backoff import doubling
from runtime.blob import BlobStoreConfig
from runtime.blob._base import backoff_s
from runtime.bus import election_backoff_s
from runtime.run_config import SupervisorSection

HUGE = [1024, 1025, 10_000, 10**9]


def test_doubling_doubles_up_to_its_cap_for_any_count() -> None:
    assert [doubling(0.1, 1.0, n) for n in (-3, 0, 1, 2, 3, 4)] == [0.1, 0.1, 0.2, 0.4, 0.8, 1.0]
    for n in HUGE:
        assert doubling(0.1, 5.0, n) == 5.0
        assert doubling(0.0, 0.0, n) == 0.0
        assert doubling(3600.0, 3600.0, n) == 3600.0  # a large base: the product is inf, then the cap


@pytest.mark.parametrize("n", HUGE)
def test_every_runtime_backoff_is_its_cap_for_a_huge_count(n: int) -> None:
    config = BlobStoreConfig(url="file:///tmp/x", backoff_base_s=0.1, backoff_max_s=0.5)
    assert 0.25 <= backoff_s(config, n, random.Random(0)) <= 0.5
    assert election_backoff_s(n) == 1.0
    settings = ActorSettings()
    assert settings.nak_delay(n) == settings.nak_max_delay_s
    supervisor = SupervisorSection()
    assert supervisor.backoff(n) == supervisor.backoff_max_s


async def test_weight_sync_retry_past_1024_attempts() -> None:
    num_calls = 0

    async def flaky() -> str:
        nonlocal num_calls
        num_calls += 1
        if num_calls < 1100:
            raise ConnectionError("transient")
        return "done"

    with capture_logs():  # a warning per retry
        assert await Retry(1100, 0.0, 0.0).run("put", "k", flaky) == "done"
    assert num_calls == 1100
