"""Fixtures of the actors' unit tests."""

from __future__ import annotations

import logging

import pytest
import structlog


@pytest.fixture
def quiet_logs(request: pytest.FixtureRequest) -> None:
    """Events below the level the test module names (``QUIET_LOGS_LEVEL``, default ERROR) are dropped: these
    tests drive thousands of slot transitions through the core. tests/conftest.py restores structlog after."""
    level = getattr(request.module, "QUIET_LOGS_LEVEL", logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
