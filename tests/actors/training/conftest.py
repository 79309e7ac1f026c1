"""Fixtures of the training tests: one sandbox layer store per module (skipped where bwrap cannot run)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandbox import LayerStore
from tests.sandbox_store import open_layer_store_or_skip


@pytest.fixture(scope="module")
def store() -> Iterator[LayerStore]:
    s = open_layer_store_or_skip()
    try:
        yield s
    finally:
        s.close()
