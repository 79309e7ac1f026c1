"""Opening a sandbox layer store in a test: skipped, saying why, where bwrap cannot run on this host."""

from __future__ import annotations

import pytest

from sandbox import LayerStore, SandboxConfig
from sandbox.errors import SandboxUnavailable


def open_layer_store_or_skip(config: SandboxConfig | None = None) -> LayerStore:
    """A new `LayerStore` (the caller closes it); the test is skipped when the sandbox is unavailable."""
    try:
        return LayerStore(config) if config is not None else LayerStore()
    except SandboxUnavailable as e:
        pytest.skip(f"sandbox unavailable on this host: {e}")
