"""Fixtures of the training tests: one sandbox layer store per module (skipped where bwrap cannot run)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandbox import LayerStore
from sandbox.errors import SandboxUnavailable


@pytest.fixture(scope="module")
def store() -> Iterator[LayerStore]:
    try:
        s = LayerStore()
    except SandboxUnavailable as e:
        pytest.skip(f"sandbox unavailable on this host: {e}")
    try:
        yield s
    finally:
        s.close()
