"""Exceptions raised by the model package.

Each subclasses the builtin a caller would naturally catch, so `except ValueError` keeps working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EngineError",
    "EngineStateError",
    "ModelError",
]


class ModelError(Exception):
    """Base class of every error raised by `model`."""


class ConfigError(ModelError, ValueError):
    """A configuration value is out of range or unsupported."""


class CheckpointError(ModelError, ValueError):
    """A checkpoint directory is missing files, keys or has tensors of the wrong shape."""


class EngineError(ModelError, RuntimeError):
    """The generation engine could not serve a request."""


class EngineStateError(EngineError):
    """An engine method was called in the wrong lifecycle state."""
