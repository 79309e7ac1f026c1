"""What the forked child does between fork and exec of bwrap: cgroup, credentials, keyring.

Runs as ``preexec_fn`` (uvloop, the actors' loop, accepts no ``user=``/``group=``), so it does
only plain system calls on values prepared before the fork:

1. on cgroup v2 only (on v1 the child is born in the cgroup, see `sandbox._spawner`), still
   root, join the environment's memory cgroup by writing ``0`` to its ``cgroup.procs`` (no
   shell, no cgroup file the sandbox uid could write; bwrap and all it starts inherit it);
2. drop to the sandbox uid and gid with no supplementary groups;
3. join a fresh anonymous session keyring. Keyrings are kernel-wide, not namespaced: a child
   keeps the session keyring of the process that spawned it, and whoever possesses a keyring
   may search, read and update the keys linked from it (root's user keyring included, once a
   login, ``keyctl`` or systemd gave the host process one). The seccomp filter refuses
   ``keyctl`` inside; this makes sure there is nothing of the host's to reach if it did not.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Callable

from sandbox._seccomp import syscall_number

__all__ = ["child_setup"]

_KEYCTL_JOIN_SESSION_KEYRING = 1
_SHARED_KEYRING = b"asyncrl-sandbox"


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _fail(message: bytes) -> None:
    os.write(2, b"sandbox: " + message + b"\n")
    os._exit(126)


def child_setup(uid: int, gid: int, cgroup_procs: str | None) -> Callable[[], None]:
    """The ``preexec_fn`` of one command (everything it needs is resolved now, before the fork)."""
    libc, keyctl = _libc(), syscall_number("keyctl")
    shared_name = ctypes.c_char_p(_SHARED_KEYRING + b"-" + str(uid).encode())

    def setup() -> None:
        if cgroup_procs is not None:
            fd = os.open(cgroup_procs, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if libc.syscall(keyctl, _KEYCTL_JOIN_SESSION_KEYRING, None) >= 0:
            return
        # Out of key quota (the kernel frees the keyrings of finished commands asynchronously):
        # a keyring shared by this uid's sandboxes is still none of the host's.
        if ctypes.get_errno() != errno.EDQUOT or libc.syscall(keyctl, _KEYCTL_JOIN_SESSION_KEYRING, shared_name) < 0:
            _fail(b"cannot join a fresh session keyring: " + os.strerror(ctypes.get_errno()).encode())

    return setup
