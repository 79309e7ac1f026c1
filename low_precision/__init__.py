"""Low-precision MoE compute: NVFP4 / MXFP8 formats, quantizers, grouped GEMMs, the experts op.

The torch modules (``formats``, ``mxfp8``, ``nvfp4``, ``grouped_gemm``) define the numerics; the
``*_triton`` modules hold Triton kernels that match them byte for byte on quantized data.
"""

from low_precision.errors import (
    ExpertIndexError,
    KernelDeviceError,
    KernelDTypeError,
    KernelError,
    KernelShapeError,
    KernelStrideError,
)
from low_precision.experts import (
    ExpertsFn,
    ExpertsPrecision,
    experts_forward_emulated,
    experts_forward_reference,
    experts_forward_triton,
    make_experts_fn,
)
from low_precision.formats import ScaleMode

__all__ = [
    "ExpertIndexError",
    "ExpertsFn",
    "ExpertsPrecision",
    "KernelDTypeError",
    "KernelDeviceError",
    "KernelError",
    "KernelShapeError",
    "KernelStrideError",
    "ScaleMode",
    "experts_forward_emulated",
    "experts_forward_reference",
    "experts_forward_triton",
    "make_experts_fn",
]
