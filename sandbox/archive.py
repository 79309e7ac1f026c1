"""Export a snapshot to a zstd-compressed tar, and import one back as a single-layer snapshot.

The archive holds the snapshot's merged view (whiteouts resolved): regular files, directories and
symlinks, with owners zeroed and setuid/setgid bits stripped. Import treats the archive as hostile:
member names must be relative without ``..``, only files, directories and symlinks are accepted,
nothing is ever written through a symlink, and what it may create on the host is budgeted before it
is written (bytes the host's disk allocates: file data rounded up to whole blocks, and a block for
every directory and every symlink too long to live in its inode; inodes, including the directories
a member's path implies; and directory depth), and the finished layer is measured as ``du`` would
before it is kept. Members are streamed to disk in chunks, never held whole in memory. Both walks
are iterative and fd-based (`sandbox._tree`).
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import stat
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

import zstandard

from sandbox import _mount
from sandbox._safepath import open_dir, split_relpath, write_atomic
from sandbox._tree import (
    TreeBudget,
    TreeUsage,
    block_size,
    discard_tree,
    measure_tree,
    open_regular_at,
    symlink_estimate,
    walk,
)
from sandbox.config import SandboxLimits
from sandbox.errors import SandboxViolation, SnapshotFormatError
from sandbox.layers import LayerStore, Snapshot

__all__ = ["export_snapshot", "export_snapshot_bytes", "import_snapshot", "import_snapshot_bytes"]

_DEFAULT_MAX_BYTES = 1 << 30
_DEFAULT_MAX_INODES = SandboxLimits().num_inodes * 2
_DEFAULT_MAX_DEPTH = SandboxLimits().max_dir_depth
_CHUNK = 1 << 20
# what a hostile archive's layout (not the host) makes the OS refuse: a file where a directory
# must go, a directory where a file goes, a name too long, a symlink loop
_FORMAT_ERRORS = (NotADirectoryError, IsADirectoryError, FileExistsError)
_FORMAT_ERRNOS = {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTEMPTY}


def _tar_tree(tar: tarfile.TarFile, root: str, max_bytes: int, max_inodes: int, max_depth: int, block: int) -> None:
    num_bytes = num_members = 0  # bytes as an import charges them (`_Importer`), so it never refuses what this wrote
    for entry in walk(root, max_depth):
        if entry.leaving:
            continue
        num_members += 1
        if num_members > max_inodes:
            raise SandboxViolation(
                f"the snapshot holds more than max_inodes={max_inodes} files and directories (an import "
                "would refuse it); delete files from the workspace"
            )
        mode = entry.st.st_mode
        info = tarfile.TarInfo("/".join(entry.rel))
        info.mode = stat.S_IMODE(mode) & 0o777
        info.mtime = int(entry.st.st_mtime)
        if stat.S_ISDIR(mode):
            info.type = tarfile.DIRTYPE
            _check_export_bytes(num_bytes := num_bytes + block, max_bytes)
            tar.addfile(info)
        elif stat.S_ISLNK(mode):
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(entry.name, dir_fd=entry.parent_fd)
            _check_export_bytes(num_bytes := num_bytes + symlink_estimate(info.linkname, block), max_bytes)
            tar.addfile(info)
        elif stat.S_ISREG(mode):
            fd = open_regular_at(entry)
            with os.fdopen(fd, "rb") as f:
                info.size = os.fstat(fd).st_size
                _check_export_bytes(num_bytes := num_bytes + _blocks(info.size, block), max_bytes)
                tar.addfile(info, f)
        # whiteouts (at the bottom layer), FIFOs, sockets, devices: not part of a workspace


def _blocks(num_bytes: int, block: int) -> int:
    return -(-num_bytes // block) * block


def _check_export_bytes(num_bytes: int, max_bytes: int) -> None:
    if num_bytes > max_bytes:
        raise SandboxViolation(
            f"the snapshot takes more than max_bytes={max_bytes} bytes of disk once imported (holes count: an "
            "archive stores them; so do directories and long symlinks, a block each); delete files from the workspace"
        )


def export_snapshot(
    snapshot: Snapshot,
    stream: BinaryIO,
    *,
    level: int = 3,
    max_bytes: int = _DEFAULT_MAX_BYTES,
    max_inodes: int = _DEFAULT_MAX_INODES,
    max_depth: int = _DEFAULT_MAX_DEPTH,
) -> None:
    """Write ``snapshot`` as a zstd tar to a binary stream (the stream is left open).

    Raises:
        SandboxViolation: the files hold more than ``max_bytes`` (as the archive stores them,
            holes included), more than ``max_inodes`` entries, or nest deeper than ``max_depth``:
            an import with the same budgets would refuse it.
    """
    store = snapshot.store
    max_depth = max(max_depth, *(layer.usage.depth for layer in snapshot.layers))
    block = _layers_block(store)
    with zstandard.ZstdCompressor(level=level).stream_writer(stream, closefd=False) as zw:  # noqa: SIM117
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            if snapshot.depth == 1:
                _tar_tree(tar, snapshot.layers[0].path, max_bytes, max_inodes, max_depth, block)
                return
            point = os.path.join(store.envs_dir, "x-" + secrets.token_hex(6))
            os.mkdir(point, 0o700)
            lower = ":".join(layer.view for layer in snapshot.layers)
            _mount.mount("asyncrl-export", point, "overlay", _mount.MS_RDONLY, f"lowerdir={lower}")
            try:
                _tar_tree(tar, point, max_bytes, max_inodes, max_depth, block)
            finally:
                _mount.umount(point)
                os.rmdir(point)


def export_snapshot_bytes(
    snapshot: Snapshot, *, level: int = 3, max_bytes: int = _DEFAULT_MAX_BYTES, max_inodes: int = _DEFAULT_MAX_INODES
) -> bytes:
    """`export_snapshot` into memory."""
    buf = io.BytesIO()
    export_snapshot(snapshot, buf, level=level, max_bytes=max_bytes, max_inodes=max_inodes)
    return buf.getvalue()


def _layers_block(store: LayerStore) -> int:
    fd = os.open(store.layers_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return block_size(fd)
    finally:
        os.close(fd)


def _chunks(src: BinaryIO) -> Iterator[bytes]:
    while chunk := src.read(_CHUNK):
        yield chunk


class _Importer:
    """Extracts members one at a time into a layer directory, charging each to the budget first."""

    def __init__(self, store: LayerStore, layer: str, budget: TreeBudget) -> None:
        self.store, self.layer, self.budget = store, layer, budget
        self._block = _layers_block(store)
        self.usage = TreeUsage(num_bytes=self._block)  # the layer's own directory
        self._dirs: set[tuple[str, ...]] = set()

    def _charge(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        dir_parts = parts if member.isdir() else parts[:-1]
        if len(dir_parts) > self.budget.max_depth:
            raise SnapshotFormatError(
                f"archive member {member.name!r} nests {len(dir_parts)} directories, more than "
                f"max_depth={self.budget.max_depth}"
            )
        new_dirs = {dir_parts[:i] for i in range(1, len(dir_parts) + 1)} - self._dirs
        num_inodes = len(new_dirs) + (0 if member.isdir() else 1)
        num_bytes = len(new_dirs) * self._block
        if member.isreg():
            num_bytes += _blocks(member.size, self._block)
        elif member.issym():
            num_bytes += symlink_estimate(member.linkname, self._block)
        try:
            self.usage.charge(self.budget, num_bytes=num_bytes, num_inodes=num_inodes, what="import")
        except SandboxViolation as e:
            limit = (
                f"max_bytes={self.budget.max_bytes} bytes of disk (file data, directories and long symlinks)"
                if self.usage.num_bytes + num_bytes > self.budget.max_bytes
                else f"max_inodes={self.budget.max_inodes} files and directories"
            )
            raise SnapshotFormatError(f"archive holds more than {limit} (at member {member.name!r})") from e
        self._dirs |= new_dirs
        self.usage.depth = max(self.usage.depth, len(dir_parts))

    def extract(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        cfg = self.store.config
        uid, gid = self.store.layer_owner
        if not (member.isreg() or member.isdir() or member.issym()):
            raise SnapshotFormatError(
                f"archive member {member.name!r} has type {member.type!r}; only files, directories and "
                "symlinks are allowed"
            )
        try:
            parts = split_relpath(member.name, cfg.workspace_dir)
        except SandboxViolation as e:
            raise SnapshotFormatError(f"archive member {member.name!r} escapes the workspace: {e}") from e
        if not parts:
            return
        self._charge(member, parts)
        if member.isdir():
            os.close(open_dir(self.layer, parts, create=True, uid=uid, gid=gid))
        elif member.isreg():
            src = tar.extractfile(member)
            assert src is not None
            write_atomic(self.layer, parts, _chunks(src), uid=uid, gid=gid, mode=member.mode & 0o777)
        else:
            dir_fd = open_dir(self.layer, parts[:-1], create=True, uid=uid, gid=gid)
            try:
                os.symlink(member.linkname, parts[-1], dir_fd=dir_fd)
                os.chown(parts[-1], uid, gid, dir_fd=dir_fd, follow_symlinks=False)
            finally:
                os.close(dir_fd)


def import_snapshot(
    store: LayerStore,
    stream: BinaryIO,
    *,
    max_bytes: int = _DEFAULT_MAX_BYTES,
    max_inodes: int = _DEFAULT_MAX_INODES,
    max_depth: int = _DEFAULT_MAX_DEPTH,
) -> Snapshot:
    """Read a zstd tar written by `export_snapshot` into a new one-layer snapshot.

    Args:
        max_bytes: bytes of file content it may write on the host.
        max_inodes: files, directories and symlinks it may create (implied parents included).
        max_depth: directories it may nest.

    Raises:
        SnapshotFormatError: not a zstd tar, a forbidden or conflicting member, or over a budget;
            nothing of it is left on the host.
    """
    layer_id, path = store.new_layer_dir()
    os.chown(path, *store.layer_owner)
    importer = _Importer(store, path, TreeBudget(max_bytes, max_inodes, max_depth))
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stream, closefd=False)
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            for member in tar:
                try:
                    importer.extract(tar, member)
                except SandboxViolation as e:
                    raise SnapshotFormatError(f"archive member {member.name!r} is unsafe: {e}") from e
                except OSError as e:
                    if not isinstance(e, _FORMAT_ERRORS) and e.errno not in _FORMAT_ERRNOS:
                        raise
                    raise SnapshotFormatError(f"archive member {member.name!r} conflicts with another: {e}") from e
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
        discard_tree(path)
        raise SnapshotFormatError(f"not a valid zstd tar snapshot: {e}") from e
    except BaseException:
        discard_tree(path)
        raise
    os.chmod(path, 0o755)
    try:
        # what the disk really allocated (directories grown by their entries, extent blocks)
        usage = measure_tree(path, max_depth)
        if usage.num_bytes > max_bytes:
            raise SnapshotFormatError(
                f"archive takes {usage.num_bytes} bytes of disk once unpacked, more than max_bytes={max_bytes}"
            )
    except BaseException:
        discard_tree(path)
        raise
    return Snapshot(store, (store.adopt(layer_id, path, usage),))


def import_snapshot_bytes(
    store: LayerStore,
    data: bytes,
    *,
    max_bytes: int = _DEFAULT_MAX_BYTES,
    max_inodes: int = _DEFAULT_MAX_INODES,
    max_depth: int = _DEFAULT_MAX_DEPTH,
) -> Snapshot:
    """`import_snapshot` from memory."""
    return import_snapshot(store, io.BytesIO(data), max_bytes=max_bytes, max_inodes=max_inodes, max_depth=max_depth)
