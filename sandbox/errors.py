"""Exceptions raised by the sandbox package.

Each subclasses the builtin a caller would naturally catch, so ``except RuntimeError``
or ``except PermissionError`` keeps working without importing this module.
"""

from __future__ import annotations

__all__ = [
    "SandboxError",
    "SandboxStateError",
    "SandboxUnavailable",
    "SandboxViolation",
    "SnapshotFormatError",
]


class SandboxError(Exception):
    """Base class of every sandbox error."""


class SandboxUnavailable(SandboxError, RuntimeError):
    """The host lacks something the sandbox needs (bwrap, overlayfs, root, user namespaces)."""


class SandboxStateError(SandboxError, RuntimeError):
    """An operation was called in the wrong lifecycle state (closed environment, busy, ...)."""


class SandboxViolation(SandboxError, PermissionError):
    """A path or argument tried to reach outside the workspace (``..``, symlink, hard link, device)."""


class SnapshotFormatError(SandboxError, ValueError):
    """An imported snapshot archive is malformed or contains forbidden members."""
