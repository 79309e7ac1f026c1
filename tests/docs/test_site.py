"""The documentation site builds with ``mkdocs build --strict``: a broken link or anchor, a page missing from the
nav or a nav entry without its page fails (mkdocs.yml, ``validation``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("mkdocs-material is needed (the dev extra): run scripts/bootstrap.sh")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, on every build
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
