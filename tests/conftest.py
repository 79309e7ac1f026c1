"""Session-wide test set-up.

Without a GPU, Triton kernels can only run under the Triton interpreter, and ``triton.jit`` decides
between compiling and interpreting when a kernel module is first imported — by whichever test package
imports ``low_precision`` first (the actors import it too). So the choice is made here, before any test
module is imported, once for the whole session.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import structlog
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.s3_fixtures"]
INTEGRATION = Path(__file__).resolve().parent / "integration"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No property here is about time, and a loaded 2-core CI machine can take any one example past Hypothesis's
# default 200 ms deadline (reported as a flaky failure), or generate data slowly enough to fail its health check.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/integration runs the whole system (real processes, servers, clusters): mark it
    ``system``, so ``scripts/test.sh --fast`` (``-m "not system"``) leaves it out without a list to keep.

    Then the longest first (``slow``, then the rest of ``system``): parallel workers (pytest-xdist) take
    them at the start, beside the short ones, instead of ending the suite with one long test on one worker
    while the others idle."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.system)
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.get_closest_marker("system") is None))


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Iterator[None]:
    """Each test leaves structlog configured as it found it. A bench's ``main`` called in-process configures a
    level filter, and ``structlog.testing.capture_logs`` swaps the processors only: a later test on the same
    worker would capture none of its info events."""
    saved = dict(structlog.get_config())
    saved["processors"] = list(saved["processors"])
    yield
    structlog.configure(**saved)


# --- the CPU each test costs: where a suite on two cores spends its time --------------------------------------
CPU_KEY = pytest.StashKey[float]()
SHOWN_CPU = 20


def _cpu_s() -> float:
    """CPU-seconds of this process and of its children that have exited (the processes a test started)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[CPU_KEY] = _cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    if call.when == "teardown" and CPU_KEY in item.stash:  # carried to the controller with the report (xdist)
        item.user_properties.append(("cpu_s", _cpu_s() - item.stash[CPU_KEY]))
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_s":
                _CPU_BY_TEST[report.nodeid] = float(value)


_CPU_BY_TEST: dict[str, float] = {}  # the controller's record of this session's tests (filled by the hook above)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The costliest tests by CPU (the test's process and its exited children; Ray's daemons are not counted):
    on a 2-core machine the suite's wall time is about its CPU over two."""
    if not _CPU_BY_TEST:
        return
    total = sum(_CPU_BY_TEST.values())
    terminalreporter.write_sep("=", f"costliest {SHOWN_CPU} by CPU (of {total:.0f} CPU-s in all)")
    for nodeid, cpu in sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:SHOWN_CPU]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s  {nodeid}")
