"""Exceptions of weight sync: one base class, each kind subclassing the builtin it behaves as."""

from __future__ import annotations

__all__ = [
    "BaseMismatch",
    "CorruptVersion",
    "IncompleteVersion",
    "PublishFailed",
    "VersionUnavailable",
    "WeightSyncError",
]


class WeightSyncError(Exception):
    """Base class of weight-sync errors."""


class BaseMismatch(WeightSyncError, ValueError):
    """A delta was offered a base other than the one it was encoded against."""


class CorruptVersion(WeightSyncError, ValueError):
    """A manifest or shard failed validation: bad checksum, truncated, malformed or mislabelled."""


class VersionUnavailable(WeightSyncError, LookupError):
    """The requested version, or a version its chain needs, is not in the store."""


class IncompleteVersion(VersionUnavailable):
    """Some ranks of a version have published their part and others have not (yet, or ever)."""


class PublishFailed(WeightSyncError, RuntimeError):
    """A version was not published (storage kept failing, its base failed, or a newer one replaced it)."""
