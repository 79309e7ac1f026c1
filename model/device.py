"""Which device a model-holding process computes on: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.

``auto`` is CUDA when the process was given a GPU (``torch.cuda.is_available()``: the backend hides
the others with ``CUDA_VISIBLE_DEVICES``), else the CPU. An explicit ``cuda`` on a machine without one
is an error that says so, never a silent fall back to the CPU: a run that asked for a GPU and trains
on the CPU would be hundreds of times slower without a word.
"""

from __future__ import annotations

import re

import torch

from model.errors import ConfigError

__all__ = ["check_device_spec", "resolve_device"]

_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def check_device_spec(spec: str, *, key: str = "policy.device") -> None:
    """Raises ConfigError unless ``spec`` reads as a device (availability is checked by resolve_device)."""
    if not _SPEC.match(spec):
        raise ConfigError(f"{key}={spec!r}: use auto, cpu, cuda or cuda:N (N the GPU's index)")


def resolve_device(spec: str, *, key: str = "policy.device") -> torch.device:
    """The torch device ``spec`` names on this machine.

    Raises:
        ConfigError: the spec is malformed, or names a GPU this process does not have.
    """
    check_device_spec(spec, key=key)
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={spec!r}, but this process sees no CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda is not None}); use auto or cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{key}={spec!r}, but this process sees {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return device
