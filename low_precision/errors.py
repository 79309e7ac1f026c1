"""Exception hierarchy of the kernels package.

Every launcher and reference function validates its inputs and raises one of these; each subclasses
the builtin a caller would naturally catch (``except ValueError`` keeps working).
"""

from __future__ import annotations

__all__ = [
    "ExpertIndexError",
    "KernelDTypeError",
    "KernelDeviceError",
    "KernelError",
    "KernelShapeError",
    "KernelStrideError",
]


class KernelError(Exception):
    """Base class of every error raised by ``low_precision``."""


class KernelShapeError(KernelError, ValueError):
    """A tensor has the wrong rank or size for the operation."""


class KernelDTypeError(KernelError, TypeError):
    """A tensor has a dtype the operation does not accept."""


class KernelStrideError(KernelError, ValueError):
    """A tensor's memory layout (strides, device) is not the one the kernel addresses."""


class ExpertIndexError(KernelError, IndexError):
    """A routed expert index is outside [0, num_experts)."""


class KernelDeviceError(KernelError, RuntimeError):
    """The Triton kernels cannot run on this tensor's device (CPU without TRITON_INTERPRET=1)."""
