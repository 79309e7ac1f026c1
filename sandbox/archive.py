"""Export a snapshot to a zstd-compressed tar, and import one back as a single-layer snapshot.

The archive holds the snapshot's merged view (whiteouts resolved): regular files, directories and
symlinks, with owners zeroed and setuid/setgid bits stripped. Import treats the archive as hostile:
member names must be relative without ``..``, only files, directories and symlinks are accepted,
nothing is ever written through a symlink, and the total size is bounded.
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import tarfile
from typing import BinaryIO

import zstandard

from sandbox import _mount
from sandbox._safepath import open_dir, split_relpath, write_atomic
from sandbox.errors import SandboxViolation, SnapshotFormatError
from sandbox.layers import LayerStore, Snapshot

__all__ = ["export_snapshot", "export_snapshot_bytes", "import_snapshot", "import_snapshot_bytes"]

_DEFAULT_MAX_BYTES = 1 << 30


def _tar_tree(tar: tarfile.TarFile, root: str) -> None:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames) + sorted(filenames):
            path = os.path.join(dirpath, name)
            arcname = os.path.normpath(os.path.join(rel_dir, name))
            info = tar.gettarinfo(path, arcname)
            if not (info.isreg() or info.isdir() or info.issym()):
                continue  # whiteouts (at the bottom layer), FIFOs, sockets, devices
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode &= 0o777
            if info.isreg():
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def export_snapshot(snapshot: Snapshot, stream: BinaryIO, *, level: int = 3) -> None:
    """Write ``snapshot`` as a zstd tar to a binary stream (the stream is left open)."""
    store = snapshot.store
    with zstandard.ZstdCompressor(level=level).stream_writer(stream, closefd=False) as zw:  # noqa: SIM117
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            if snapshot.depth == 1:
                _tar_tree(tar, snapshot.layers[0].path)
                return
            point = os.path.join(store.envs_dir, "x-" + secrets.token_hex(6))
            os.mkdir(point, 0o700)
            lower = ":".join(layer.path for layer in snapshot.layers)
            _mount.mount("asyncrl-export", point, "overlay", _mount.MS_RDONLY, f"lowerdir={lower}")
            try:
                _tar_tree(tar, point)
            finally:
                _mount.umount(point)
                os.rmdir(point)


def export_snapshot_bytes(snapshot: Snapshot, *, level: int = 3) -> bytes:
    """`export_snapshot` into memory."""
    buf = io.BytesIO()
    export_snapshot(snapshot, buf, level=level)
    return buf.getvalue()


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, layer: str, store: LayerStore) -> None:
    uid, gid = store.config.sandbox_uid, store.config.sandbox_gid
    try:
        parts = split_relpath(member.name, store.config.workspace_dir)
    except SandboxViolation as e:
        raise SnapshotFormatError(f"archive member {member.name!r} escapes the workspace: {e}") from e
    if not parts:
        return
    if member.isdir():
        os.close(open_dir(layer, parts, create=True, uid=uid, gid=gid))
        return
    if member.isreg():
        src = tar.extractfile(member)
        assert src is not None
        write_atomic(layer, parts, src.read(), uid=uid, gid=gid, mode=member.mode & 0o777)
        return
    if member.issym():
        dir_fd = open_dir(layer, parts[:-1], create=True, uid=uid, gid=gid)
        try:
            os.symlink(member.linkname, parts[-1], dir_fd=dir_fd)
            os.chown(parts[-1], uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(dir_fd)
        return
    raise SnapshotFormatError(
        f"archive member {member.name!r} has type {member.type!r}; only files, directories and symlinks are allowed"
    )


def import_snapshot(store: LayerStore, stream: BinaryIO, *, max_bytes: int = _DEFAULT_MAX_BYTES) -> Snapshot:
    """Read a zstd tar written by `export_snapshot` into a new one-layer snapshot.

    Raises:
        SnapshotFormatError: not a zstd tar, a forbidden member, or more than ``max_bytes`` of files.
    """
    layer_id, path = store.new_layer_dir()
    os.chown(path, store.config.sandbox_uid, store.config.sandbox_gid)
    total = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stream, closefd=False)
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            for member in tar:
                total += member.size if member.isreg() else 0
                if total > max_bytes:
                    raise SnapshotFormatError(f"archive holds more than max_bytes={max_bytes} bytes of files")
                try:
                    _extract_member(tar, member, path, store)
                except SandboxViolation as e:
                    raise SnapshotFormatError(f"archive member {member.name!r} is unsafe: {e}") from e
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
        shutil.rmtree(path, ignore_errors=True)
        raise SnapshotFormatError(f"not a valid zstd tar snapshot: {e}") from e
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    os.chmod(path, 0o755)
    return Snapshot(store, (store.adopt(layer_id, path),))


def import_snapshot_bytes(store: LayerStore, data: bytes, *, max_bytes: int = _DEFAULT_MAX_BYTES) -> Snapshot:
    """`import_snapshot` from memory."""
    return import_snapshot(store, io.BytesIO(data), max_bytes=max_bytes)
