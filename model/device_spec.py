"""How a device is named in a run's configuration: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.

Checked where the configuration is read, by every actor process, most of which hold no model (the
reconciler): so this imports no torch. What a spec resolves to on a machine is `model.device`'s.
"""

from __future__ import annotations

import re

from model.errors import ConfigError

__all__ = ["check_device_spec"]

_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def check_device_spec(spec: str, *, key: str = "policy.device") -> None:
    """Raises ConfigError unless ``spec`` reads as a device (availability is checked by resolve_device)."""
    if not _SPEC.match(spec):
        raise ConfigError(f"{key}={spec!r}: use auto, cpu, cuda or cuda:N (N the GPU's index)")
