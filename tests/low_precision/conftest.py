"""Kernel tests run the Triton kernels on CPU through the Triton interpreter (tests/gpu runs them compiled).

Set here for this directory, before its test modules import ``low_precision``; see tests/triton_mode.py.
"""

from __future__ import annotations

from tests.triton_mode import use_triton_mode

use_triton_mode(interpret=True)
