"""Which device a model-holding process computes on: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.

``auto`` is CUDA when the process was given a GPU (``torch.cuda.is_available()``: the backend hides
the others with ``CUDA_VISIBLE_DEVICES``), else the CPU. An explicit ``cuda`` on a machine without one
is an error that says so, never a silent fall back to the CPU: a run that asked for a GPU and trains
on the CPU would be hundreds of times slower without a word. How a spec reads is `model.device_spec`'s.
"""

from __future__ import annotations

import torch

from model.device_spec import check_device_spec
from model.errors import ConfigError

__all__ = ["resolve_device"]


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
