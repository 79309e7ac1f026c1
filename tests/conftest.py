"""Session-wide test set-up.

Without a GPU, Triton kernels can only run under the Triton interpreter, and ``triton.jit`` decides
between compiling and interpreting when a kernel module is first imported — by whichever test package
imports ``low_precision`` first (the actors import it too). So the choice is made here, before any test
module is imported, once for the whole session.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.s3_fixtures"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No property here is about time, and a loaded 2-core CI machine can take any one example past Hypothesis's
# default 200 ms deadline (reported as a flaky failure), or generate data slowly enough to fail its health check.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")
