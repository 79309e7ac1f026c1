"""Switch the ``low_precision.*_triton`` modules between compiled and interpreted Triton in a test session.

``triton.jit`` decides between compiling and interpreting (TRITON_INTERPRET=1) when a kernel is
*defined*, so switching means setting the variable and reloading the modules that define kernels, in
dependency order. Reloading refills each module's own namespace, so functions imported earlier by
other modules see the new kernels; data classes and exceptions live in other modules and keep their
identity.
"""

from __future__ import annotations

import importlib
import os
import sys

TRITON_MODULES = (
    "low_precision._triton_formats",
    "low_precision.mxfp8_triton",
    "low_precision.nvfp4_triton",
    "low_precision.grouped_gemm_triton",
    "low_precision._backends",
)


def kernels_interpreted() -> bool:
    """Whether the kernel modules, as imported now, run under the interpreter."""
    from low_precision._backends import triton_interpreted

    return triton_interpreted()


def use_triton_mode(*, interpret: bool) -> None:
    """Make the kernel modules compiled or interpreted, reloading them if they are not already so."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    if "low_precision._backends" in sys.modules and kernels_interpreted() == interpret:
        return
    for name in TRITON_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)
