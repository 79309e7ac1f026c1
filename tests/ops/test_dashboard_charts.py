"""The dashboard's charts in a real headless Chromium, fed the series a run can produce that upset uPlot: a
series flat up to float noise (uPlot's tick loop never ends on it: leeoniya/uPlot#1084), exactly flat, one
point, zeros, a row without its x. Every chart draws, with a finite, non-empty range on each axis."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver

from tests.browser import browser  # noqa: F401 - the fixture

STATIC = Path(__file__).resolve().parents[2] / "ops" / "dashboard" / "static"
NOISY_ONE = [0.9999997615814209, 1.000000238418579]  # 1 in float32, give or take an ulp or two


@pytest.fixture
def page_url(tmp_path: Path) -> Iterator[str]:
    """The page's own files, served as the dashboard serves them (under /static), with no run behind them."""
    shutil.copy(STATIC / "index.html", tmp_path / "index.html")
    (tmp_path / "static").symlink_to(STATIC)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    finally:
        server.shutdown()
        thread.join(10)


def _train_rows(count: int, value: object) -> list[dict[str, object]]:
    fields = ("reward_mean", "pass_rate", "loss", "pg_loss", "kl", "ratio_mean", "ratio_median", "ratio_min",
              "ratio_max", "lr", "grad_norm", "samples_per_s", "trainer_utilisation", "tokens_per_s", "lag_min",
              "lag_max")
    return [{"version": v, **{f: value(v) if callable(value) else value for f in fields}} for v in range(count)]


CASES = {
    "flat up to float noise": _train_rows(40, lambda v: NOISY_ONE[v % 2]),
    "a learning rate flat up to float noise": _train_rows(40, lambda v: 3e-4 * NOISY_ONE[v % 2]),
    "exactly flat": _train_rows(10, 1.0),
    "one point": _train_rows(1, 0.5),
    "zeros": _train_rows(10, 0.0),
    "a row without its x": [*_train_rows(5, lambda v: v / 10), {"version": None, "loss": 1.0}],
    "none": [],
}


def test_every_chart_draws_what_a_run_can_produce(page_url: str, browser: webdriver.Chrome) -> None:  # noqa: F811
    browser.get(page_url)
    for case, rows in CASES.items():
        _check_drawn(case, browser.execute_script(
        """
        const rows = arguments[0];
        window.dashboard.state.train = rows;
        window.dashboard.state.eval = rows.length ? [{version: rows[0].version, pass_at_1: 0.5}] : [];
        window.dashboard.state.slots = rows.map((r, i) => ({time: 1e9 + i, queued: r.loss, training: r.loss}));
        try { drawCharts(); } catch (e) { return String(e); }
        return Object.fromEntries(Object.entries(window.dashboard.charts).map(([id, c]) =>
          [id, Object.values(c.plot.scales).filter(s => s.min !== null && s.min !== undefined)
                                           .map(s => [s.min, s.max])]));
        """, rows))


def _check_drawn(case: str, drawn: str | dict[str, list[list[float]]]) -> None:
    assert not isinstance(drawn, str), f"{case}: drawing threw {drawn}"
    assert set(drawn) >= {"chart-reward", "chart-loss", "chart-ratio", "chart-lr", "chart-slots"}
    for chart, ranges in drawn.items():
        for low, high in ranges:
            assert low < high, f"{case}, {chart}: an empty range [{low}, {high}]"
