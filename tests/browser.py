"""A real headless Chromium (Selenium) for the tests of web pages: the fixture and the console check."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail("chromium and chromedriver are needed: run scripts/bootstrap.sh (Debian: chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2400"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: webdriver.Chrome, refused: str = "/api/config - Failed to load resource: "
                   "the server responded with a status of 400") -> list[dict[str, Any]]:
    """SEVERE console entries, less Chrome's note of a 400 a test provoked on purpose (a refused value)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and refused not in e["message"]]
