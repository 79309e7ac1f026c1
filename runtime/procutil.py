"""Process helpers shared by the supervisor and the embedded server."""

from __future__ import annotations

import ctypes
import os
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


def lower_priority(nice: int) -> None:
    """Give way on the CPU by ``nice`` (0 to 19): this process's niceness, and its autogroup's.

    A supervised actor starts a session of its own, and with the kernel's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``) each session is scheduled as one group, where a
    process's niceness only ranks it within its own group; so the group's niceness is set too.
    Call it in the process itself once its session exists (after setsid).
    """
    if nice <= 0:
        return
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup support (or not Linux): the process niceness alone applies
        pass
