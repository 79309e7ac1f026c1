"""Session-wide test set-up.

Without a GPU, Triton kernels can only run under the Triton interpreter, and ``triton.jit`` decides
between compiling and interpreting when a kernel module is first imported — by whichever test package
imports ``kernels`` first (the actors import it too). So the choice is made here, before any test
module is imported, once for the whole session.
"""

from __future__ import annotations

import os

import torch

pytest_plugins = ["tests.s3_fixtures"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
