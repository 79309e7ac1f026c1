"""The site's generated pages are what their generators write now (``python -m ops.docs --check``), and the
configuration reference lists every key ``--print-config`` prints."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from ops.docs import config_reference
from ops.docs.pages import DOCS, generate

REPO = Path(__file__).resolve().parents[2]


def test_every_generated_page_is_current() -> None:
    outcome = generate(DOCS, check=True)
    assert outcome.stale == [], "stale generated pages: run python -m ops.docs and commit the result"


def test_the_configuration_reference_lists_every_key_print_config_prints() -> None:
    done = subprocess.run([sys.executable, "-m", "actors", "--print-config"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = {config_reference.page_key(k) for k in config_reference.flat_keys(tomllib.loads(done.stdout))}
    page = (DOCS / config_reference.PAGE).read_text(encoding="utf-8")
    listed = config_reference.documented_keys(page)
    assert sorted(printed - set(listed)) == [], "keys --print-config prints that the reference does not list"
    # What the reference lists and --print-config does not print: the keys it says are unset (TOML has no null)
    assert sorted(set(listed) - printed) == sorted(k for k, is_printed in listed.items() if not is_printed)
    kinds = {k.split(".")[1] for k in config_reference.flat_keys(tomllib.loads(done.stdout)) if k.startswith("actors.")}
    assert sorted(k for k in kinds if f"| `{k}` |" not in page) == [], "kinds of the default run the page omits"
