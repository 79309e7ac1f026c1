"""Kernel tests run the Triton kernels on CPU through the Triton interpreter.

``triton.jit`` decides between compiling and interpreting when a kernel is *defined*, so
TRITON_INTERPRET=1 must be set before the ``kernels.*_triton`` modules are imported. This conftest sets
it for this directory only. If another test package imported those modules first (as compiled
kernels), they are reloaded in dependency order; data classes and exceptions live in other modules
and keep their identity.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_TRITON_MODULES = (
    "kernels._triton_formats",
    "kernels.mxfp8_triton",
    "kernels.nvfp4_triton",
    "kernels.grouped_gemm_triton",
    "kernels._backends",
)


def _ensure_interpreted() -> None:
    import triton

    quant = sys.modules.get("kernels.nvfp4_triton")
    if quant is None or not isinstance(quant._nvfp4_quant_kernel, triton.runtime.JITFunction):
        return
    for name in _TRITON_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)


_ensure_interpreted()
