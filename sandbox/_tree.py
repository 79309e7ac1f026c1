"""Iterative, fd-based walks over trees that sandboxed code built: copy, remove, enumerate.

Trees under a workspace are written by the policy, so nothing here recurses (1,000 nested
directories end a recursive walk with ``RecursionError``), nothing follows a path twice (every
step opens the next component from an open directory fd with ``O_NOFOLLOW`` and checks that what
it opened is what it listed, so a symlink or file swapped in concurrently fails the walk), and a
copy writes on the host only what the source really holds: holes of sparse files stay holes,
hard links stay links, and a `TreeBudget` caps bytes, inodes and depth before they are written.
Bytes are what the host's disk allocates (``st_blocks``, as ``du`` counts), not what the files
say they hold: a directory, an out-of-line symlink and the last partial block of a file cost
whole blocks there, so 30,000 empty directories are 117 MiB of disk, not 0 bytes. Each entry is
charged a block-rounded estimate before it is made and settled to its real allocation after (a
directory when it is complete, as its entries make it grow).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from sandbox.errors import SandboxViolation

__all__ = [
    "DIR_FLAGS",
    "Entry",
    "TreeBudget",
    "TreeUsage",
    "allocated_bytes",
    "block_size",
    "copy_tree",
    "discard_tree",
    "measure_tree",
    "open_regular_at",
    "remove_entry",
    "remove_tree",
    "symlink_estimate",
    "walk",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
log = structlog.get_logger(__name__)

_OPAQUE_XATTR = "trusted.overlay.opaque"
_CHUNK = 1 << 20
_MAX_LINK_PATH = 3072  # below PATH_MAX: longer link targets are copied (and charged) instead
_INLINE_SYMLINK_MAX = 59  # ext4 keeps a target this short in the inode; longer ones take a block


def allocated_bytes(st: os.stat_result) -> int:
    """What an inode costs its filesystem in data blocks (``du``'s measure)."""
    return st.st_blocks * 512


def block_size(fd: int) -> int:
    """The allocation unit of the filesystem of ``fd``."""
    return max(os.fstatvfs(fd).f_frsize, 512)


def _round_up(num_bytes: int, block: int) -> int:
    return -(-num_bytes // block) * block


def symlink_estimate(target: str | bytes, block: int) -> int:
    """Bytes a symlink to ``target`` is charged before it is made (a block unless it is short)."""
    size = len(os.fsencode(target))
    return 0 if size <= _INLINE_SYMLINK_MAX else _round_up(size, block)


@dataclass(frozen=True)
class TreeBudget:
    """The most a tree may cost on the host: allocated bytes (data, directory and symlink blocks,
    as ``du`` counts them), inodes, and directory depth.

    Depth counts nested directories below the root (a file at the root is at depth 0).
    """

    max_bytes: int
    max_inodes: int
    max_depth: int

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_inodes", "max_depth"):
            if getattr(self, name) < 0:
                raise ValueError(f"TreeBudget.{name}={getattr(self, name)} must be >= 0")


@dataclass
class TreeUsage:
    """What a copy wrote: allocated bytes (holes excluded, metadata blocks included), new inodes,
    and the deepest directory."""

    num_bytes: int = 0
    num_inodes: int = 0
    depth: int = 0

    def charge(self, budget: TreeBudget, *, num_bytes: int = 0, num_inodes: int = 0, what: str) -> None:
        if self.num_bytes + num_bytes > budget.max_bytes:
            raise SandboxViolation(
                f"{what}: more than the {budget.max_bytes} bytes allowed on the host disk; "
                "delete large files from the workspace"
            )
        if self.num_inodes + num_inodes > budget.max_inodes:
            raise SandboxViolation(
                f"{what}: more than the {budget.max_inodes} files and directories allowed; "
                "delete files from the workspace"
            )
        self.num_bytes += num_bytes
        self.num_inodes += num_inodes

    def settle(self, budget: TreeBudget, estimate: int, st: os.stat_result, *, what: str) -> None:
        """Replace an entry's ``estimate`` by what it really allocated (``st``), which may be more."""
        self.charge(budget, num_bytes=allocated_bytes(st) - estimate, what=what)


@dataclass(frozen=True)
class Entry:
    """One step of `walk`: an entry ``name`` in the open directory ``parent_fd``.

    For a directory, ``fd`` is the directory itself (open until its ``leaving`` step); the root
    appears only once, as the last step, with ``leaving`` set and ``name`` empty.
    """

    parent_fd: int
    name: str
    st: os.stat_result
    rel: tuple[str, ...]
    fd: int = -1
    leaving: bool = False


def _same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_dev == b.st_dev and a.st_ino == b.st_ino


def _changed(rel: tuple[str, ...]) -> SandboxViolation:
    return SandboxViolation(f"{'/'.join(rel) or '.'} changed while the host walked it; nothing may run in it now")


def _open_dir_at(
    parent_fd: int, name: str, expected: os.stat_result, rel: tuple[str, ...]
) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise _changed(rel) from e
        raise
    st = os.fstat(fd)
    if not _same_inode(st, expected):
        os.close(fd)
        raise _changed(rel)
    return fd, st


def walk(root: str, max_depth: int) -> Iterator[Entry]:
    """Every entry under ``root`` (sorted, parents before children, ``leaving`` after them).

    Holds one fd per directory level, so ``max_depth`` also bounds the fds used.

    Raises:
        SandboxViolation: a directory deeper than ``max_depth``, or the tree changed under the walk.
    """
    root_fd = os.open(root, DIR_FLAGS)
    # frames: (fd, stat, rel, remaining names reversed, parent fd, name)
    stack: list[tuple[int, os.stat_result, tuple[str, ...], list[str], int, str]] = []
    try:
        stack.append((root_fd, os.fstat(root_fd), (), sorted(os.listdir(root_fd), reverse=True), -1, ""))
        while stack:
            fd, dir_st, rel, names, parent_fd, dir_name = stack[-1]
            if not names:
                yield Entry(parent_fd, dir_name, dir_st, rel, fd=fd, leaving=True)
                stack.pop()
                os.close(fd)
                continue
            name = names.pop()
            child_rel = (*rel, name)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError as e:
                raise _changed(child_rel) from e
            if not stat.S_ISDIR(st.st_mode):
                yield Entry(fd, name, st, child_rel)
                continue
            if len(child_rel) > max_depth:
                raise SandboxViolation(
                    f"{'/'.join(child_rel[:3])}/... nests directories deeper than the {max_depth} levels allowed; "
                    "flatten the tree"
                )
            child_fd, child_st = _open_dir_at(fd, name, st, child_rel)
            try:
                child_names = sorted(os.listdir(child_fd), reverse=True)
            except BaseException:  # not on the stack yet: closed here
                os.close(child_fd)
                raise
            stack.append((child_fd, child_st, child_rel, child_names, fd, name))
            yield Entry(fd, name, child_st, child_rel, fd=child_fd)
    finally:
        for frame in stack:
            os.close(frame[0])


def open_regular_at(entry: Entry) -> int:
    """Open ``entry`` (a regular file) for reading, checking it is still the file listed."""
    try:
        fd = os.open(entry.name, _FILE_FLAGS, dir_fd=entry.parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOENT, errno.ENXIO):
            raise _changed(entry.rel) from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not _same_inode(st, entry.st):
        os.close(fd)
        raise _changed(entry.rel)
    return fd


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    os.lseek(dst_fd, offset, os.SEEK_SET)
    end = offset + length
    while offset < end:
        sent = os.sendfile(dst_fd, src_fd, offset, min(end - offset, 1 << 30))
        if sent == 0:  # the source shrank under us
            break
        offset += sent


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the parts of a file that hold data; holes are skipped."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole remains
                return
            if e.errno == errno.EINVAL:  # no SEEK_DATA on this filesystem: all data
                yield pos, size - pos
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            yield start, end - start
        pos = end


def _copy_file(entry: Entry, dst_dir_fd: int, usage: TreeUsage, budget: TreeBudget, block: int, what: str) -> None:
    src = open_regular_at(entry)
    try:
        usage.charge(budget, num_inodes=1, what=what)
        dst = os.open(
            entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_dir_fd
        )
        try:
            size = os.fstat(src).st_size
            estimate = 0
            for offset, length in _data_extents(src, size):
                usage.charge(budget, num_bytes=_round_up(length, block), what=what)
                estimate += _round_up(length, block)
                _copy_range(src, dst, offset, length)
            os.ftruncate(dst, size)  # trailing hole
            os.fchmod(dst, stat.S_IMODE(entry.st.st_mode) & 0o1777)
            usage.settle(budget, estimate, os.fstat(dst), what=what)  # extent blocks of a fragmented file
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _link_earlier_copy(first: tuple[str, ...], entry: Entry, dst_root_fd: int, dst_dir_fd: int) -> bool:
    target = "/".join(first)
    if len(target) > _MAX_LINK_PATH:
        return False
    try:
        os.link(target, entry.name, src_dir_fd=dst_root_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.EMLINK, errno.ENAMETOOLONG, errno.ENOENT):
            return False
        raise
    return True


def _copy_dir_metadata(
    src_fd: int, dst_fd: int, st: os.stat_result, keep_whiteouts: bool, owner: tuple[int, int] | None
) -> None:
    if keep_whiteouts:
        try:
            value = os.getxattr(src_fd, _OPAQUE_XATTR)
        except OSError:
            value = None
        if value is not None:
            os.setxattr(dst_fd, _OPAQUE_XATTR, value)
    os.fchown(dst_fd, *(owner or (st.st_uid, st.st_gid)))
    os.fchmod(dst_fd, stat.S_IMODE(st.st_mode) & 0o1777)
    os.utime(dst_fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def copy_tree(
    src: str,
    dst: str,
    *,
    keep_whiteouts: bool,
    budget: TreeBudget,
    owner: tuple[int, int] | None = None,
    what: str = "snapshot",
) -> TreeUsage:
    """Copy an overlayfs layer (or a merged view) into the empty directory ``dst``.

    Preserves regular files (holes kept), hard links (as links), directories, symlinks, owners
    (or gives every entry ``owner``), permission bits (setuid/setgid stripped), mtimes, whiteouts
    and opaque markers (when ``keep_whiteouts``); drops FIFOs, sockets and devices. Never
    follows symlinks.

    Raises:
        SandboxViolation: the copy would exceed ``budget`` or the source changed under it;
            ``dst`` then holds a partial copy for the caller to remove.
    """
    usage = TreeUsage()
    links: dict[tuple[int, int], tuple[str, ...]] = {}
    dst_fds = [os.open(dst, DIR_FLAGS)]
    block = block_size(dst_fds[0])
    estimates = [0]  # per open destination directory: what it was charged when made (the root: nothing)
    try:
        for entry in walk(src, budget.max_depth):
            if entry.leaving:
                dst_fd = dst_fds.pop()
                try:
                    usage.settle(budget, estimates.pop(), os.fstat(dst_fd), what=what)  # grown by its entries
                    _copy_dir_metadata(entry.fd, dst_fd, entry.st, keep_whiteouts, owner)
                finally:
                    os.close(dst_fd)
                continue
            parent = dst_fds[-1]
            mode = entry.st.st_mode
            if stat.S_ISDIR(mode):
                usage.charge(budget, num_bytes=block, num_inodes=1, what=what)
                usage.depth = max(usage.depth, len(entry.rel))
                os.mkdir(entry.name, 0o700, dir_fd=parent)
                dst_fds.append(os.open(entry.name, DIR_FLAGS, dir_fd=parent))
                estimates.append(block)
                continue
            if stat.S_ISREG(mode):
                key = (entry.st.st_dev, entry.st.st_ino)
                first = links.get(key) if entry.st.st_nlink > 1 else None
                if first is not None and _link_earlier_copy(first, entry, dst_fds[0], parent):
                    continue
                _copy_file(entry, parent, usage, budget, block, what)
                if entry.st.st_nlink > 1 and first is None:
                    links[key] = entry.rel
            elif stat.S_ISLNK(mode):
                target = os.readlink(entry.name, dir_fd=entry.parent_fd)
                estimate = symlink_estimate(target, block)
                usage.charge(budget, num_bytes=estimate, num_inodes=1, what=what)
                os.symlink(target, entry.name, dir_fd=parent)
                usage.settle(budget, estimate, os.stat(entry.name, dir_fd=parent, follow_symlinks=False), what=what)
            elif keep_whiteouts and stat.S_ISCHR(mode) and entry.st.st_rdev == 0:
                usage.charge(budget, num_inodes=1, what=what)
                os.mknod(entry.name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent)
            else:
                continue  # FIFOs, sockets, devices
            uid, gid = owner or (entry.st.st_uid, entry.st.st_gid)
            os.chown(entry.name, uid, gid, dir_fd=parent, follow_symlinks=False)
            os.utime(entry.name, ns=(entry.st.st_atime_ns, entry.st.st_mtime_ns), dir_fd=parent, follow_symlinks=False)
    finally:
        for fd in dst_fds:
            os.close(fd)
    return usage


def measure_tree(root: str, max_depth: int) -> TreeUsage:
    """What the tree at ``root`` costs its filesystem: allocated bytes (``du``'s count, the root
    and each hard-linked inode once), inodes below the root, and directory depth."""
    usage, seen = TreeUsage(), set()
    for entry in walk(root, max_depth):
        key = (entry.st.st_dev, entry.st.st_ino)
        if key in seen:
            continue
        seen.add(key)
        usage.num_bytes += allocated_bytes(entry.st)
        if entry.rel:
            usage.num_inodes += 1
        if stat.S_ISDIR(entry.st.st_mode):
            usage.depth = max(usage.depth, len(entry.rel))
    return usage


def remove_entry(parent_fd: int, name: str) -> None:
    """Delete ``name`` in ``parent_fd`` and everything under it, at any depth, with O(1) fds.

    Descends with ``O_NOFOLLOW`` and climbs back through ``..``, checking each parent is the
    directory it left, so a tree rearranged under it fails instead of deleting elsewhere.

    Raises:
        SandboxViolation: the tree changed while it was being removed.
    """
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    fd, st = _open_dir_at(parent_fd, name, st, (name,))
    try:
        # one frame per level: (name in its parent, identity, subdirectories still to remove)
        frames: list[tuple[str, os.stat_result, list[str]]] = [(name, st, _clear_files(fd, st))]
        while True:
            child_name, _, pending = frames[-1]
            if pending:
                sub = pending.pop()
                sub_st = os.stat(sub, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(sub_st.st_mode):
                    os.unlink(sub, dir_fd=fd)
                    continue
                sub_fd, sub_st = _open_dir_at(fd, sub, sub_st, (sub,))
                fd, parent = sub_fd, fd  # held by `fd` before the close: never closed twice
                os.close(parent)
                frames.append((sub, sub_st, _clear_files(fd, sub_st)))
                continue
            if len(frames) == 1:
                break
            up = os.open("..", DIR_FLAGS, dir_fd=fd)
            if not _same_inode(os.fstat(up), frames[-2][1]):
                os.close(up)
                raise _changed((child_name,))
            fd, child = up, fd
            os.close(child)
            os.rmdir(child_name, dir_fd=fd)
            frames.pop()
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _clear_files(fd: int, st: os.stat_result) -> list[str]:
    """Unlink every non-directory in ``fd``; return the subdirectories on the same filesystem."""
    subdirs = []
    for name in os.listdir(fd):
        child = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISDIR(child.st_mode):
            os.unlink(name, dir_fd=fd)
        elif child.st_dev == st.st_dev:
            subdirs.append(name)
        else:
            raise SandboxViolation(f"{name!r} is a mount point; unmount it before removing the tree")
    return subdirs


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it (iteratively); a missing path is not an error."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        parent_fd = os.open(parent or ".", DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        remove_entry(parent_fd, name)
    finally:
        os.close(parent_fd)


def discard_tree(path: str) -> bool:
    """`remove_tree` for clean-up paths: never raises, logs what it could not remove; True when gone."""
    try:
        remove_tree(path)
    except (OSError, SandboxViolation) as e:
        log.error("sandbox_tree_not_removed", path=path, error=str(e))
        return False
    return True
