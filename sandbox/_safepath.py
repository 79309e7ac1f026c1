"""Workspace-confined file access from the host, immune to ``..``, symlinks and mount crossings.

Every path is validated lexically (relative, no ``..``, no NUL) and then walked one component at
a time from an open directory fd with ``O_NOFOLLOW``, so a symlink anywhere on the path, even one
swapped in concurrently, fails the call instead of being followed. Files are only ever read if
they are regular files, and writes replace the directory entry (write to a temporary file, then
rename) so a hard link can never be written through. Each directory step checks the device
number so the walk cannot cross into another mount.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable, Iterator

from sandbox._tree import DIR_FLAGS, remove_entry
from sandbox.errors import SandboxViolation

__all__ = [
    "MAX_PATH_BYTES",
    "open_dir",
    "read_regular",
    "split_relpath",
    "write_atomic",
]

MAX_PATH_BYTES = 1024
_DIR_FLAGS = DIR_FLAGS


def split_relpath(path: str, workspace_dir: str = "/workspace") -> tuple[str, ...]:
    """Validate a workspace path and return its components ("" or "." is the root: ``()``).

    Accepts relative paths and absolute ones under ``workspace_dir``.

    Raises:
        SandboxViolation: the path is absolute elsewhere, contains ``..``, NUL or is too long.
        TypeError: ``path`` is not a string.
    """
    if not isinstance(path, str):
        raise TypeError(f"path must be a string, got {type(path).__name__}")
    if "\x00" in path:
        raise SandboxViolation("path contains a NUL byte")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise SandboxViolation(f"path is longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        if path == workspace_dir or path.startswith(workspace_dir.rstrip("/") + "/"):
            path = path[len(workspace_dir) :]
        else:
            raise SandboxViolation(f"path {path!r} is outside the workspace; use a path relative to {workspace_dir}")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise SandboxViolation(f"path {path!r} contains '..'; paths must stay inside the workspace")
    return parts


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _open_child_dir(parent_fd: int, name: str, root_dev: int) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        st = _lstat_or_none(parent_fd, name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise SandboxViolation(f"{name!r} is a symlink; file tools do not follow symlinks") from e
        raise
    if os.fstat(fd).st_dev != root_dev:
        os.close(fd)
        raise SandboxViolation(f"{name!r} is on another filesystem; file tools stay in the workspace")
    return fd


def _lstat_or_none(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir(root: str, parts: tuple[str, ...], *, create: bool = False, uid: int = -1, gid: int = -1) -> int:
    """Open the directory ``root/parts`` without following symlinks; optionally create it.

    Created directories get mode 0755 and owner ``uid:gid``. The caller closes the returned fd.
    """
    fd = os.open(root, _DIR_FLAGS)
    root_dev = os.fstat(fd).st_dev
    try:
        for name in parts:
            if create and _lstat_or_none(fd, name) is None:
                os.mkdir(name, 0o755, dir_fd=fd)
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
            child = _open_child_dir(fd, name, root_dev)
            fd, parent = child, fd  # held by `fd` before the close: never closed twice
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(root: str, parts: tuple[str, ...], max_bytes: int) -> bytes:
    """Read a regular file of at most ``max_bytes`` bytes.

    Raises:
        SandboxViolation: a symlink, device, FIFO, socket or a file on another mount.
        IsADirectoryError / FileNotFoundError: as the OS reports.
        ValueError: the file is larger than ``max_bytes``.
    """
    if not parts:
        raise IsADirectoryError("the workspace root is a directory")
    with _fd(open_dir(root, parts[:-1])) as dir_fd:
        st = _lstat_or_none(dir_fd, parts[-1])
        if st is None:
            raise FileNotFoundError(f"no such file: {'/'.join(parts)}")
        if stat.S_ISLNK(st.st_mode):
            raise SandboxViolation(f"{'/'.join(parts)} is a symlink; file tools do not follow symlinks")
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{'/'.join(parts)} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise SandboxViolation(f"{'/'.join(parts)} is not a regular file")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with _fd(os.open(parts[-1], flags, dir_fd=dir_fd)) as fd:
            fst = os.fstat(fd)
            # (no st_dev check here: overlayfs reports lower-layer files with their real device)
            if not stat.S_ISREG(fst.st_mode):
                raise SandboxViolation(f"{'/'.join(parts)} changed type while opening")
            if fst.st_size > max_bytes:
                raise ValueError(f"{'/'.join(parts)} has {fst.st_size} bytes, more than the {max_bytes} allowed")
            chunks, remaining = [], max_bytes + 1
            while remaining > 0:
                chunk = os.read(fd, min(remaining, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                remaining -= len(chunk)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise ValueError(f"{'/'.join(parts)} grew past the {max_bytes} bytes allowed")
            return data


def write_atomic(
    root: str,
    parts: tuple[str, ...],
    data: bytes | Iterable[bytes],
    *,
    uid: int,
    gid: int,
    mode: int | None = None,
    make_parents: bool = True,
    force: bool = False,
) -> None:
    """Replace ``root/parts`` with a new regular file holding ``data`` (temp file + rename).

    ``data`` is the content, or an iterable of its chunks (streamed, never held whole).

    ``mode`` defaults to the old file's permission bits (setuid/setgid stripped) or 0644.
    With ``force``, anything in the way (a symlink or file where a directory is needed, a
    directory where the file goes) is removed first; used to install hidden tests.
    """
    if not parts:
        raise IsADirectoryError("cannot write to the workspace root")
    if force:
        fd = os.open(root, _DIR_FLAGS)
        try:
            for name in parts[:-1]:
                st = _lstat_or_none(fd, name)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    remove_entry(fd, name)
                if _lstat_or_none(fd, name) is None:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                child = _open_child_dir(fd, name, os.fstat(fd).st_dev)
                fd, parent = child, fd
                os.close(parent)
            st = _lstat_or_none(fd, parts[-1])
            if st is not None and stat.S_ISDIR(st.st_mode):
                remove_entry(fd, parts[-1])
        finally:
            os.close(fd)
    with _fd(open_dir(root, parts[:-1], create=make_parents, uid=uid, gid=gid)) as dir_fd:
        old = _lstat_or_none(dir_fd, parts[-1])
        if old is not None and stat.S_ISDIR(old.st_mode):
            raise IsADirectoryError(f"{'/'.join(parts)} is a directory")
        if mode is None:
            mode = stat.S_IMODE(old.st_mode) & 0o777 if old is not None and stat.S_ISREG(old.st_mode) else 0o644
        tmp = f".{parts[-1][:40]}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            for chunk in (data,) if isinstance(data, bytes | bytearray | memoryview) else data:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode & 0o777)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.close(fd)
        try:
            os.rename(tmp, parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
