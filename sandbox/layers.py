"""Read-only filesystem layers and snapshots, owned and reference-counted by a `LayerStore`.

A layer is a directory on the host disk in overlayfs format (whiteouts are 0:0 character
devices, opaque directories carry ``trusted.overlay.opaque``). A `Snapshot` is an ordered
stack of layers (top first). Environments and snapshots retain the layers they use; a layer is
deleted when its last holder lets go. The store owns one private directory under the configured
root (so several processes can share the root) and removes it, with every mount in it, on close.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Mapping

import structlog

from sandbox import _cgroup, _mount
from sandbox._host import check_host, prepare_static_dir
from sandbox._safepath import split_relpath, write_atomic
from sandbox.config import SandboxConfig
from sandbox.errors import SandboxStateError, SandboxUnavailable

__all__ = ["Layer", "LayerStore", "Snapshot", "copy_tree"]

log = structlog.get_logger(__name__)

_OPAQUE_XATTR = "trusted.overlay.opaque"


class Layer:
    """One immutable layer directory; identity is its path."""

    __slots__ = ("id", "path")

    def __init__(self, layer_id: str, path: str) -> None:
        self.id = layer_id
        self.path = path

    def __repr__(self) -> str:
        return f"Layer({self.id})"


class Snapshot:
    """A frozen filesystem state: a stack of layers, top first. Release it when done."""

    __slots__ = ("_released", "id", "layers", "store")

    def __init__(self, store: LayerStore, layers: tuple[Layer, ...]) -> None:
        self.store = store
        self.layers = layers
        self.id = secrets.token_hex(8)
        self._released = False
        store.retain(layers)

    @property
    def depth(self) -> int:
        return len(self.layers)

    def release(self) -> None:
        """Drop this snapshot's hold on its layers (idempotent)."""
        if not self._released:
            self._released = True
            self.store.release(self.layers)

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Snapshot({self.id}, depth={self.depth})"


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def copy_tree(src: str, dst: str, *, keep_whiteouts: bool) -> int:
    """Copy an overlayfs layer (or a merged view) into the empty directory ``dst``.

    Preserves regular files, directories, symlinks, owners, permission bits (setuid/setgid
    stripped), mtimes, whiteouts and opaque markers (when ``keep_whiteouts``); drops FIFOs,
    sockets and devices. Never follows symlinks. Returns the number of bytes copied.
    """
    num_bytes = 0
    st = os.lstat(src)
    os.chmod(dst, stat.S_IMODE(st.st_mode) & 0o1777)
    os.chown(dst, st.st_uid, st.st_gid)
    if keep_whiteouts:
        _copy_opaque(src, dst)
    with os.scandir(src) as it:
        entries = list(it)
    for entry in entries:
        s, d = entry.path, os.path.join(dst, entry.name)
        est = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(est.st_mode):
            os.mkdir(d)
            num_bytes += copy_tree(s, d, keep_whiteouts=keep_whiteouts)
        elif stat.S_ISREG(est.st_mode):
            shutil.copyfile(s, d, follow_symlinks=False)
            os.chmod(d, stat.S_IMODE(est.st_mode) & 0o1777)
            num_bytes += est.st_size
        elif stat.S_ISLNK(est.st_mode):
            os.symlink(os.readlink(s), d)
        elif _is_whiteout(est) and keep_whiteouts:
            os.mknod(d, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        else:
            continue
        os.chown(d, est.st_uid, est.st_gid, follow_symlinks=False)
        if not stat.S_ISDIR(est.st_mode):
            os.utime(d, ns=(est.st_atime_ns, est.st_mtime_ns), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return num_bytes


def _copy_opaque(src: str, dst: str) -> None:
    try:
        value = os.getxattr(src, _OPAQUE_XATTR, follow_symlinks=False)
    except OSError:
        return
    os.setxattr(dst, _OPAQUE_XATTR, value, follow_symlinks=False)


class LayerStore:
    """Owns layer directories and environment mount points under ``config.root_dir``.

    Raises:
        SandboxUnavailable: (on construction) bwrap, overlayfs, root or user namespaces missing.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.bwrap_path = check_host(self.config)
        os.makedirs(self.config.root_dir, mode=0o711, exist_ok=True)
        os.chmod(self.config.root_dir, 0o711)
        _reap_stale(self.config.root_dir)
        self.dir = os.path.join(self.config.root_dir, f"{os.getpid()}-{secrets.token_hex(4)}")
        self.layers_dir = os.path.join(self.dir, "L")
        self.envs_dir = os.path.join(self.dir, "E")
        for d in (self.dir, self.layers_dir, self.envs_dir):
            os.mkdir(d, 0o711)
        self.static_dir = prepare_static_dir(self.dir, self.config)
        _probe_mounts(self.dir)
        self.name = os.path.basename(self.dir)
        self.cgroup: tuple[str, int] | None = None
        if self.config.memory_cgroup:
            self.cgroup = _cgroup.probe(self.name, self.config.sandbox_uid, self.config.sandbox_gid)
            if self.cgroup is not None:
                _cgroup.reap_stale(self.cgroup[0])
        self._refs: dict[str, int] = {}
        self._layers: dict[str, Layer] = {}
        self._by_content: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        log.info("sandbox_store_opened", dir=self.dir, memory_cgroup=self.cgroup is not None)

    # -- layers --------------------------------------------------------------------------
    def new_layer_dir(self) -> tuple[str, str]:
        """Reserve an empty directory for a layer being built; returns (id, path)."""
        self._check_open()
        layer_id = secrets.token_hex(6)
        path = os.path.join(self.layers_dir, layer_id)
        os.mkdir(path, 0o755)
        return layer_id, path

    def adopt(self, layer_id: str, path: str) -> Layer:
        """Register a fully built layer directory (unreferenced until retained)."""
        layer = Layer(layer_id, path)
        with self._lock:
            self._layers[layer_id] = layer
            self._refs[layer_id] = 0
        return layer

    def layer_from_files(self, files: Mapping[str, str | bytes]) -> Layer:
        """A layer holding ``files`` (path -> content), shared with any live layer of equal content."""
        digest = hashlib.sha256()
        for path in sorted(files):
            content = files[path]
            data = content.encode() if isinstance(content, str) else bytes(content)
            digest.update(path.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        key = digest.hexdigest()
        with self._lock:
            existing = self._by_content.get(key)
            if existing is not None and existing in self._layers:
                return self._layers[existing]
        layer_id, path = self.new_layer_dir()
        uid, gid = self.config.sandbox_uid, self.config.sandbox_gid
        os.chown(path, uid, gid)
        for rel, content in files.items():
            data = content.encode() if isinstance(content, str) else bytes(content)
            parts = split_relpath(rel, self.config.workspace_dir)
            write_atomic(path, parts, data, uid=uid, gid=gid, mode=0o644)
        layer = self.adopt(layer_id, path)
        with self._lock:
            self._by_content[key] = layer_id
        return layer

    def retain(self, layers: tuple[Layer, ...]) -> None:
        with self._lock:
            for layer in layers:
                self._refs[layer.id] += 1

    def release(self, layers: tuple[Layer, ...]) -> None:
        doomed = []
        with self._lock:
            for layer in layers:
                self._refs[layer.id] -= 1
                if self._refs[layer.id] == 0:
                    del self._refs[layer.id]
                    del self._layers[layer.id]
                    doomed.append(layer)
            for key in [k for k, v in self._by_content.items() if v not in self._layers]:
                del self._by_content[key]
        for layer in doomed:
            shutil.rmtree(layer.path, ignore_errors=True)

    def num_layers(self) -> int:
        with self._lock:
            return len(self._layers)

    def snapshot_from_files(self, files: Mapping[str, str | bytes]) -> Snapshot:
        """A snapshot of a workspace holding ``files``: hold one per task and fork it per rollout."""
        self._check_open()
        return Snapshot(self, (self.layer_from_files(files),))

    # -- lifecycle -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxStateError(f"LayerStore {self.dir} is closed; expected open")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmount everything under the store and delete it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _mount.umount_tree(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        log.info("sandbox_store_closed", dir=self.dir)

    def __enter__(self) -> LayerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _probe_mounts(store_dir: str) -> None:
    """Mount a tiny tmpfs and an overlay on it, so a host that forbids either fails clearly now."""
    probe = os.path.join(store_dir, "probe")
    os.mkdir(probe, 0o700)
    try:
        _mount.mount("asyncrl-probe", probe, "tmpfs", _mount.MS_NOSUID | _mount.MS_NODEV, "size=1m")
        for name in ("lower", "upper", "work", "merged"):
            os.mkdir(os.path.join(probe, name))
        options = ",".join(f"{k}dir={os.path.join(probe, k)}" for k in ("lower", "upper", "work"))
        _mount.mount("asyncrl-probe", os.path.join(probe, "merged"), "overlay", _mount.MS_NOSUID, options)
    except OSError as e:
        _mount.umount_tree(probe)
        shutil.rmtree(store_dir, ignore_errors=True)
        raise SandboxUnavailable(
            f"cannot mount the sandbox's tmpfs/overlayfs workspaces ({e}); in a container, run it with "
            "CAP_SYS_ADMIN (e.g. docker --privileged) or run on the host as root"
        ) from e
    _mount.umount_tree(probe)
    shutil.rmtree(probe)


_STORE_DIR_RE = re.compile(r"^(.*/(\d+)-[0-9a-f]{8})/[EL]/")


def _reap_stale(root: str) -> None:
    """Remove store directories (and their mounts) left by processes that no longer exist:
    every store under ``root``, and any store elsewhere that still has sandbox mounts."""
    stale = set()
    for name in os.listdir(root):
        pid_text = name.split("-", 1)[0]
        if pid_text.isdigit() and not os.path.exists(f"/proc/{pid_text}"):
            stale.add(os.path.join(root, name))
    for point in _mount.mounts_with_source_prefix("asyncrl-"):
        match = _STORE_DIR_RE.match(point)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            stale.add(match.group(1))
    for path in sorted(stale):
        _mount.umount_tree(path)
        if not _mount.mounts_under(path):
            shutil.rmtree(path, ignore_errors=True)
        log.warning("sandbox_stale_store_reaped", dir=path)
