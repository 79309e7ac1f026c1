"""Process helpers shared by the supervisor and the embedded server."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when its parent dies, so no process is ever orphaned.

    Runs in the forked child before exec; Linux only (prctl), a no-op elsewhere.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
