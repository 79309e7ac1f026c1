"""The dashboard in a real headless Chromium (Selenium) against a live short run of the default job:
every section renders without a console error, the charts gain points while the run advances, a live
configuration edit made on the page reaches the actors; then ``python -m ops.dashboard`` serves the
finished run from its files. Screenshots are saved (DASHBOARD_SCREENSHOTS=dir keeps them)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from ops.dashboard.prometheus import DOCUMENTED, LABELS
from runtime.metrics_log import read_run_metrics
from tests.browser import browser, console_errors  # noqa: F401 - the fixture
from tests.integration.harness import REPO, LiveRun, run_events
from tests.integration.test_e2e import _short_run, starting_policy  # noqa: F401 - the fixture
from tests.waiting import until

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

LIVE_STEPS = 300  # within the dataset's batches (no run_steps_exceed_dataset warning)
SECTIONS = ("training", "throughput", "pipeline", "rollouts", "actors", "config", "events")


def _screenshot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.execute_script("window.scrollTo(0, 0)")
    assert driver.save_screenshot(str(path)), f"no screenshot {name}"
    if keep := os.environ.get("DASHBOARD_SCREENSHOTS"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


def _points(driver: webdriver.Chrome, chart: str) -> int:
    return driver.execute_script(
        f"const c = window.dashboard.charts[{chart!r}]; return c ? c.plot.data[0].length : 0;")


async def _dashboard_url(run: LiveRun) -> str:
    (entry,) = await run.wait_actors("dashboard", 1, timeout_s=120)
    assert entry["url"].startswith("http://127.0.0.1:"), "loopback only unless configured"
    return entry["url"]


async def _scrape(url: str) -> dict[str, Any]:
    def get() -> tuple[str, str]:
        with urllib.request.urlopen(url + "metrics", timeout=30) as reply:
            return reply.headers["Content-Type"], reply.read().decode()

    content_type, text = await asyncio.to_thread(get)
    assert content_type.startswith("text/plain; version="), content_type  # the exposition format
    return {f.name: f for f in text_string_to_metric_families(text)}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def _a_trained_sample(url: str) -> str | None:
    """A kept sample the trainer's log-probs reached (the viewer's list shows ``trainer_version`` for those)."""
    listed = _get_json(f"{url}api/samples?limit=1000")["samples"]
    return next((s["sample_id"] for s in listed if "trainer_version" in s), None)


def _rollout_screenshot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> None:
    driver.execute_script("document.getElementById('rollouts').scrollIntoView()")
    assert driver.save_screenshot(str(tmp_path / f"{name}.png")), f"no screenshot {name}"
    if keep := os.environ.get("DASHBOARD_SCREENSHOTS"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / f"{name}.png", Path(keep) / f"{name}.png")


def _text(d: webdriver.Chrome, css: str) -> str:
    """The shown text of the first element ``css`` selects ('' if none), read in the page in one go: the page
    redraws its tables and panels as updates arrive, so a handle found first and read after can go stale."""
    return d.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", css)


def _texts(d: webdriver.Chrome, css: str) -> list[str]:
    """The shown text of every element ``css`` selects, read in one go (see `_text`)."""
    return d.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.innerText)", css)


def _trained_samples(families: dict[str, Any]) -> float | None:
    """The reconciler's trained-samples counter; None where this scrape has no answer of the reconciler's (each
    actor is given a bounded time to answer, which a loaded machine can pass)."""
    family = families.get("asyncrl_reconciler_lifecycle_counters")
    samples = [s for s in family.samples if s.labels["key"] == "trained_samples"] if family else []
    return samples[0].value if len(samples) == 1 else None


async def test_dashboard_live_in_a_browser(tmp_path: Path, starting_policy: Path, browser: webdriver.Chrome) -> None:  # noqa: F811
    # more steps than the test lives through: every check below is made against a run still going (the test
    # stops it), however slow the machine; a run of 4 steps could end under a slow test and take its page along
    cfg = _short_run(tmp_path, seed=0, steps=LIVE_STEPS, checkpoint=starting_policy)
    run = await LiveRun(tmp_path / "run", cfg, "--set", "dashboard.port=0", "--set", "dashboard.sample_s=0.5").start()
    try:
        url = await _dashboard_url(run)
        browser.get(url)
        WebDriverWait(browser, 60).until(lambda d: _text(d, "#connection") == "live")
        for section in SECTIONS:
            assert browser.find_element(By.ID, section).is_displayed(), section
        await until(lambda: browser.find_elements(By.CSS_SELECTOR, "#actor-table tbody tr"), 60, "actors listed")
        await until(lambda: _points(browser, "chart-slots") >= 2, 60, "slot-table samples charted")
        _screenshot(browser, tmp_path, "dashboard-start")

        # a rollout actor killed: the table shows the replacement with the restart counted, and the crash
        victim = (await run.wait_actors("rollout", 1))[0]
        os.kill(victim["pid"], signal.SIGKILL)

        def health_cells(d: webdriver.Chrome) -> dict[str, list[str]]:
            return d.execute_script(
                "return Object.fromEntries([...document.querySelectorAll('#actor-table tbody tr')].map("
                "r => [r.cells[1].textContent, [r.cells[9].textContent, r.cells[10].textContent]]))")

        WebDriverWait(browser, 120, poll_frequency=1).until(
            lambda d: any(h == "ok" and r == "1" for h, r in health_cells(d).values()))
        assert browser.execute_script(f"return window.dashboard.state.health[{victim['id']!r}].health") == "crashed"
        _screenshot(browser, tmp_path, "dashboard-restart")

        # the curves gain points as the trainer publishes versions, without a page reload
        first = _points(browser, "chart-reward")
        await until(lambda: _points(browser, "chart-reward") >= first + 2, 300, "two more training steps charted")
        assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1

        # a live key edited on the page reaches every actor that holds the configuration
        row = browser.find_element(By.CSS_SELECTOR, 'tr[data-key="reward.length_coef"]')
        row.find_element(By.TAG_NAME, "input").send_keys("0.01")
        row.find_element(By.TAG_NAME, "button").click()
        WebDriverWait(browser, 30).until(lambda d: "sent to the actors" in _text(d, "#config-result"))
        await until(lambda: any(e.get("key") == "reward.length_coef" and e.get("new") == 0.01
                                 for e in run_events(run.run_dir, "config_changed") if e.get("kind") == "reward"),
                     60, "the reward actor applied the edit")
        shown_value = 'tr[data-key="reward.length_coef"] td:nth-child(2)'
        WebDriverWait(browser, 30).until(lambda d: _text(d, shown_value) == "0.01")
        # a value the schema refuses is refused on the page, with the reason
        row = browser.find_element(By.CSS_SELECTOR, 'tr[data-key="reward.length_coef"]')
        row.find_element(By.TAG_NAME, "input").send_keys("lots")
        row.find_element(By.TAG_NAME, "button").click()
        WebDriverWait(browser, 30).until(lambda d: "refused" in _text(d, "#config-result"))

        # the rollout viewer: a kept sample, whole, its tokens coloured by the policy version that sampled them
        def sample_rows(d: webdriver.Chrome) -> list[Any]:
            d.find_element(By.ID, "sample-refresh").click()
            return d.find_elements(By.CSS_SELECTOR, "#sample-table tbody tr")

        WebDriverWait(browser, 120, poll_frequency=2).until(sample_rows)
        # in the page, in one go: the list re-renders on every refresh, so element handles go stale
        browser.execute_script("document.querySelector('#sample-table tbody tr').click()")
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tokens span"))
        spans = browser.execute_script(
            "return [...document.querySelectorAll('.tokens span')].map(s => ({cls: s.className, "
            "version: s.dataset.version, bg: getComputedStyle(s).backgroundColor}))")
        sampled = [s for s in spans if s["cls"] != "untrained"]
        assert sampled and all(int(s["version"]) >= 0 for s in sampled)
        assert all(s["bg"] not in ("rgba(0, 0, 0, 0)", "") for s in sampled), "coloured by version"
        assert any(s["cls"] == "untrained" for s in spans), "the prompt, not sampled, is shown apart"
        _rollout_screenshot(browser, tmp_path, "dashboard-rollout")

        # a trained sample: each trained token with its behaviour and trainer log-probs, the sample's summary
        trained_id = await until(lambda: asyncio.to_thread(_a_trained_sample, url), 120,
                                 "a kept sample with the trainer's log-probs")
        whole = _get_json(f"{url}api/samples/{trained_id}")
        num_scored = sum(int(numpy.isfinite(numpy.frombuffer(base64.b64decode(seg), dtype="<f4")).sum())
                         for seg in whole["trainer_logprobs"])
        assert num_scored > 0
        # as an operator finds it: the list filtered by its prompt (the page lists the latest 200 samples)
        browser.find_element(By.ID, "sample-prompt").send_keys(whole["prompt_id"])

        def trained_sample_picked(d: webdriver.Chrome) -> bool:  # found and clicked in one go: a refresh redraws
            d.find_element(By.ID, "sample-refresh").click()  # the list, and the detail shown is another sample's
            return d.execute_script(
                "const row = document.querySelector(`#sample-table tr[data-sample=\"${arguments[0]}\"]`);"
                "if (row) { document.getElementById('sample-detail').replaceChildren(); row.click(); }"
                "return row !== null", trained_id)

        WebDriverWait(browser, 60, poll_frequency=2).until(trained_sample_picked)
        WebDriverWait(browser, 30).until(
            lambda d: trained_id in _text(d, "#sample-detail p") and _text(d, "#trainer-summary"))
        summary = _text(browser, "#trainer-summary")
        assert summary.startswith(f"trainer log-probs (policy version {whole['trainer_version']}"), summary
        assert "mean |Δ|" in summary and "ratio exp(trainer − behaviour)" in summary, summary
        scored = browser.execute_script(
            "return [...document.querySelectorAll('.tokens span.token[data-trainer]')].map(s => ({b: +s.dataset."
            "behaviour, t: +s.dataset.trainer, d: +s.dataset.delta, title: s.title, marked: s.classList.contains("
            "'large-delta')}))")
        assert len(scored) == num_scored, "every scored token of the sample, and only those, shows both log-probs"
        for tok in scored:
            assert tok["d"] == pytest.approx(tok["t"] - tok["b"], abs=1e-6) and "trainer" in tok["title"]
            assert tok["marked"] == (abs(tok["d"]) > 0.2), tok
        largest = browser.execute_script(  # the largest differences listed, with both log-probs, largest first
            "return [...document.querySelectorAll('#largest-deltas tbody tr')]"
            ".map(r => Math.abs(+r.cells[4].textContent))")
        assert len(largest) == min(20, num_scored) and largest == sorted(largest, reverse=True), largest
        _rollout_screenshot(browser, tmp_path, "dashboard-trainer-logprobs")

        # one Prometheus scrape target for the run: every documented family, every actor labelled, values move
        every_kind = {"reconciler", "rollout", "reward", "grouping", "trainer", "evaluator", "dashboard"}

        async def scrape_of_every_kind() -> dict[str, Any] | None:  # an actor may miss one scrape's deadline
            scrape = await _scrape(url)
            answered = {s.labels["kind"] for s in scrape["asyncrl_scrape_up"].samples if s.value == 1}
            return scrape if answered >= every_kind and _trained_samples(scrape) is not None else None

        first_scrape = await until(scrape_of_every_kind, 60, f"a scrape answered by every kind of {every_kind}")
        assert set(DOCUMENTED) <= set(first_scrape), set(DOCUMENTED) - set(first_scrape)
        assert all(set(LABELS) <= set(s.labels) for f in first_scrape.values() for s in f.samples)
        # the run's id, not its name ("default", as every other run's): two runs' series never collide
        assert {s.labels["run"] for f in first_scrape.values() for s in f.samples} == {run.info.run}
        trained = _trained_samples(first_scrape)

        async def counter_moved() -> bool:  # each scrape is a fresh reading of the run
            now = _trained_samples(await _scrape(url))
            return now is not None and now > trained

        await until(counter_moved, 300, "the reconciler's trained-samples counter to move", every_s=1.0)


        # the event stream filters by level: at "error" only errors (and worse) stay listed
        Select(browser.find_element(By.ID, "event-level")).select_by_visible_text("error")
        levels = set(_texts(browser, "#event-table tbody td:nth-child(2)"))
        assert levels <= {"error", "critical"}, levels
        Select(browser.find_element(By.ID, "event-level")).select_by_visible_text("info")
        assert browser.find_elements(By.CSS_SELECTOR, "#event-table tbody tr"), "info events listed again"
        _screenshot(browser, tmp_path, "dashboard-running")
        assert console_errors(browser) == []
    finally:
        await run.stop()  # drains every actor: what was trained is in the run's files
    trained = [r["version"] for r in await read_run_metrics(run.run_dir, kind="train")]
    assert len(trained) >= first + 2

    # the finished run, from its files (the live page's reconnect attempts to the stopped run are not errors)
    browser.get("about:blank")
    browser.get_log("browser")
    served = subprocess.Popen(  # noqa: ASYNC220 - its first line is read below, then it is stopped
        [sys.executable, "-m", "ops.dashboard", str(run.run_dir), "--port", "0"], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert served.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(served.stdout.readline), 60)
        assert line.startswith("dashboard  http://"), f"ops.dashboard's first line: {line!r}"
        browser.get(line.split()[1])
        WebDriverWait(browser, 60).until(lambda d: _points(d, "chart-reward") >= len(trained))
        (ended,) = run_events(run.run_dir, "supervisor_stopped")  # "stopped" here: the test stopped it
        assert _text(browser, "#connection") == ended["outcome"], "how the run ended, not live"
        snapshot = json.loads(browser.execute_script("return JSON.stringify(window.dashboard.state.train)"))
        assert [r["version"] for r in snapshot] == trained, "the same curve as the run's metrics"
        _screenshot(browser, tmp_path, "dashboard-finished")
        assert console_errors(browser) == []
    finally:
        served.terminate()
        served.wait(10)
