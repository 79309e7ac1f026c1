"""Thin wrappers over mount(2)/umount2(2) and /proc/self/mountinfo (host side, needs root)."""

from __future__ import annotations

import ctypes
import errno
import functools
import os

__all__ = [
    "MNT_DETACH",
    "MS_NODEV",
    "MS_NOSUID",
    "MS_RDONLY",
    "mount",
    "mounts_under",
    "mounts_with_source_prefix",
    "umount",
    "umount_tree",
]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    """mount(2); raises OSError with the failing target and options."""
    rc = _libc().mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} -o {data} {source} {target}: {os.strerror(err)}")


def umount(target: str, *, detach: bool = False) -> None:
    """umount2(2); a target that is not mounted is not an error."""
    rc = _libc().umount2(target.encode(), MNT_DETACH if detach else 0)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        if err == errno.EBUSY and not detach:
            umount(target, detach=True)
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix`` in this mount namespace, in mount order."""
    prefix = os.path.normpath(prefix)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


def mounts_with_source_prefix(prefix: str) -> list[str]:
    """Mount points (this namespace) whose source field starts with ``prefix``."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if len(fields) > sep + 2 and fields[sep + 2].startswith(prefix):
                found.append(_unescape(fields[4]))
    return found


def umount_tree(prefix: str) -> None:
    """Unmount everything at or below ``prefix``, deepest and newest first."""
    for point in reversed(mounts_under(prefix)):
        umount(point, detach=True)
