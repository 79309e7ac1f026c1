"""Read-only idmapped views of layer directories: root's on disk, the sandbox uid's through the view.

A layer directory on the host disk is owned by root (every entry 0:0), so no host process of the
sandbox uid could change it even if it reached it. Overlayfs does not read the directory itself
but a view of it: a detached copy of its mount (``open_tree``), made read-only and idmapped
(``mount_setattr``) through a user namespace that maps 0 to the sandbox uid and gid, and attached
under a root-only directory (``move_mount``). Through the view the workspace is the sandbox
user's to edit (copy-up gives it the sandbox uid in the writable layer); the view itself cannot be
written by anyone. Needs Linux >= 5.19 (overlayfs over idmapped layers) and a filesystem that
supports idmapped mounts; `IdmappedViews.create` returns None where they are missing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess

import structlog

from sandbox import _mount
from sandbox._seccomp import syscall_number

__all__ = ["IdmappedViews"]

log = structlog.get_logger(__name__)

_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mapping_userns(uid: int, gid: int) -> int:
    """An fd of a user namespace mapping 0 to ``uid``/``gid`` (held by a placeholder process
    only while its maps are written and its namespace file opened).

    The placeholder is ``unshare --user``, started without a ``preexec_fn`` so that subprocess
    may vfork (forking this whole process costs several times more); it says it is in its new
    namespace by writing a line, and leaves when its stdin closes.
    """
    holder = subprocess.Popen(
        ["unshare", "--user", "/bin/sh", "-c", "echo; read _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        if holder.stdout.readline() != b"\n":
            raise OSError(f"unshare --user exited ({holder.wait(timeout=10)}) before its namespace existed")
        with open(f"/proc/{holder.pid}/uid_map", "w", encoding="ascii") as f:
            f.write(f"0 {uid} 1")
        with open(f"/proc/{holder.pid}/gid_map", "w", encoding="ascii") as f:
            f.write(f"0 {gid} 1")
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.stdin.close()
        holder.stdout.close()
        holder.wait(timeout=10)


class IdmappedViews:
    """Mounts read-only views of root-owned layer directories that show them as ``uid``'s."""

    def __init__(self, userns_fd: int) -> None:
        self._userns_fd = userns_fd

    @classmethod
    def for_ids(cls, uid: int, gid: int) -> IdmappedViews:
        """Views for ``uid``/``gid`` on a host `create` already found able to make them.

        Raises:
            OSError, subprocess.SubprocessError: the mapping user namespace could not be made.
        """
        return cls(_mapping_userns(uid, gid))

    @classmethod
    def create(cls, uid: int, gid: int, probe_dir: str) -> IdmappedViews | None:
        """Views for ``uid``/``gid``, or None (logged) if this host cannot make them on the
        filesystem of ``probe_dir`` (an empty directory of the caller's)."""
        try:
            views = cls(_mapping_userns(uid, gid))
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("sandbox_layers_not_idmapped", reason=str(e))
            return None
        src, target = os.path.join(probe_dir, "src"), os.path.join(probe_dir, "view")
        os.mkdir(src, 0o755)
        os.mkdir(target, 0o700)
        try:
            views.mount(src, target)
            views_work = os.stat(target).st_uid == uid
            _mount.umount(target)
        except OSError as e:
            views.close()
            log.warning("sandbox_layers_not_idmapped", reason=str(e))
            return None
        finally:
            os.rmdir(src)
            os.rmdir(target)
        if not views_work:
            views.close()
            log.warning("sandbox_layers_not_idmapped", reason="an idmapped view did not show the mapped owner")
            return None
        return views

    def mount(self, src: str, target: str) -> None:
        """Attach a read-only, nosuid, nodev view of directory ``src`` at the empty dir ``target``."""
        libc = _libc()
        tree = _check(
            libc.syscall(syscall_number("open_tree"), _AT_FDCWD, src.encode(), _OPEN_TREE_CLONE | os.O_CLOEXEC),
            f"open_tree {src}",
        )
        try:
            attr = _MountAttr(
                _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, self._userns_fd
            )
            _check(
                libc.syscall(
                    syscall_number("mount_setattr"), tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)
                ),
                f"mount_setattr (idmap) {src}",
            )
            _check(
                libc.syscall(
                    syscall_number("move_mount"), tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
                ),
                f"move_mount {src} -> {target}",
            )
        finally:
            os.close(tree)

    def close(self) -> None:
        if self._userns_fd >= 0:
            os.close(self._userns_fd)
            self._userns_fd = -1
