"""Read-only filesystem layers and snapshots, owned and reference-counted by a `LayerStore`.

A layer is a directory on the host disk in overlayfs format (whiteouts are 0:0 character
devices, opaque directories carry ``trusted.overlay.opaque``). A `Snapshot` is an ordered
stack of layers (top first). Environments and snapshots retain the layers they use; a layer is
deleted when its last holder lets go. The store owns one private directory under the configured
root (so several processes can share the root) and removes it, with every mount in it, on close.

Layers cannot be changed by the sandbox uid on the host: every entry of a layer is root's on disk,
and overlayfs reads it through a read-only idmapped view that shows it as the sandbox uid's
(`sandbox._idmap`), so the workspace stays editable inside. Both the layers and the views live in
root-only (0700) directories, so no host process of the sandbox uid (an outer bwrap, anything
that escaped a namespace) can reach them. On a host without idmapped mounts, layer entries keep
the sandbox uid as owner and the root-only directory is the only guard (logged at start).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
from collections.abc import Mapping

import structlog

from sandbox import _cgroup, _mount
from sandbox._host import check_host, prepare_static_dir
from sandbox._idmap import IdmappedViews
from sandbox._ids import EnvIds, IdPool, check_range_is_free
from sandbox._safepath import split_relpath, write_atomic
from sandbox._tree import TreeUsage, discard_tree, measure_tree
from sandbox.config import SandboxConfig
from sandbox.errors import SandboxStateError, SandboxUnavailable

__all__ = ["Layer", "LayerStore", "Snapshot"]

log = structlog.get_logger(__name__)


class Layer:
    """One immutable layer directory; identity is its path. ``view`` is what overlayfs mounts (its
    read-only idmapped view, or ``path`` itself without one). ``usage`` is what it holds on the
    host (data bytes, inodes, directory depth), the budget of a later squash or export."""

    __slots__ = ("id", "path", "usage", "view")

    def __init__(self, layer_id: str, path: str, usage: TreeUsage, view: str | None = None) -> None:
        self.id = layer_id
        self.path = path
        self.usage = usage
        self.view = view or path

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


class LayerStore:
    """Owns layer directories and environment mount points under ``config.root_dir``.

    Raises:
        SandboxUnavailable: (on construction) bwrap, overlayfs, root or user namespaces missing.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.bwrap_path = check_host(self.config)
        if self.config.env_uid_count:
            check_range_is_free(self.config)
        os.makedirs(self.config.root_dir, mode=0o711, exist_ok=True)
        os.chmod(self.config.root_dir, 0o711)
        _reap_stale(self.config.root_dir)
        self.dir = os.path.join(self.config.root_dir, f"{os.getpid()}-{secrets.token_hex(4)}")
        self.layers_dir = os.path.join(self.dir, "L")
        self.views_dir = os.path.join(self.dir, "V")
        self.envs_dir = os.path.join(self.dir, "E")
        for d, mode in ((self.dir, 0o711), (self.layers_dir, 0o700), (self.views_dir, 0o700), (self.envs_dir, 0o711)):
            os.mkdir(d, mode)
        self.static_dir = prepare_static_dir(self.dir, self.config)
        _probe_mounts(self.dir)
        probe = os.path.join(self.layers_dir, "probe")
        os.mkdir(probe, 0o700)
        self._views = IdmappedViews.create(self.config.sandbox_uid, self.config.sandbox_gid, probe)
        os.rmdir(probe)
        self.layer_owner = (0, 0) if self._views is not None else (self.config.sandbox_uid, self.config.sandbox_gid)
        # each environment its own host uid (`sandbox._ids`); layers owned by one uid on disk
        # (no idmapped views) can be edited by that uid only, so then all share it
        self.ids: IdPool | None = None
        if self._views is not None and self.config.env_uid_count:
            try:
                self.ids = IdPool(self.config)
            except BaseException:  # the host's uid claims refused: leave nothing of this store behind
                self._views.close()
                _mount.umount_tree(self.dir)
                discard_tree(self.dir)
                raise
        elif self.config.env_uid_count:
            log.warning(
                "sandbox_env_uids_shared",
                uid=self.config.sandbox_uid,
                reason="no idmapped mounts here: every environment runs as sandbox_uid and shares its per-uid quotas",
            )
        self.name = os.path.basename(self.dir)
        self.cgroup: tuple[str, int] | None = None
        self.cgroups: _cgroup.CgroupPool | None = None
        if self.config.memory_cgroup:
            self.cgroup = _cgroup.probe(self.name, self.config.sandbox_uid, self.config.sandbox_gid)
            if self.cgroup is not None:
                _cgroup.reap_stale(self.cgroup[0])
                self.cgroups = _cgroup.CgroupPool(*self.cgroup)
        self._refs: dict[str, int] = {}
        self._layers: dict[str, Layer] = {}
        self._by_content: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        log.info(
            "sandbox_store_opened",
            dir=self.dir,
            memory_cgroup=self.cgroup is not None,
            idmapped_layers=self._views is not None,
            env_uids=f"{self.config.env_uid_base}+{self.config.env_uid_count}" if self.ids is not None else "shared",
        )

    def acquire_ids(self) -> EnvIds:
        """Host ids for a new environment: its own (released with `release_ids`), or the shared ones."""
        self._check_open()
        if self.ids is None:
            return EnvIds(self.config.sandbox_uid, self.config.sandbox_gid, None)
        return self.ids.acquire()

    # -- layers --------------------------------------------------------------------------
    def new_layer_dir(self) -> tuple[str, str]:
        """Reserve an empty directory for a layer being built; returns (id, path)."""
        self._check_open()
        layer_id = secrets.token_hex(6)
        path = os.path.join(self.layers_dir, layer_id)
        os.mkdir(path, 0o755)
        return layer_id, path

    def adopt(self, layer_id: str, path: str, usage: TreeUsage) -> Layer:
        """Register a fully built layer directory (unreferenced until retained): its entries
        owned by ``layer_owner``; from now on it is only read, through its view."""
        view = None
        if self._views is not None:
            view = os.path.join(self.views_dir, layer_id)
            os.mkdir(view, 0o700)
            try:
                self._views.mount(path, view)
            except BaseException:
                os.rmdir(view)
                discard_tree(path)
                raise
        layer = Layer(layer_id, path, usage, view)
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
        uid, gid = self.layer_owner
        os.chown(path, uid, gid)
        max_depth = 0
        try:
            for rel, content in files.items():
                data = content.encode() if isinstance(content, str) else bytes(content)
                parts = split_relpath(rel, self.config.workspace_dir)
                write_atomic(path, parts, data, uid=uid, gid=gid, mode=0o644)
                max_depth = max(max_depth, len(parts) - 1)
            usage = measure_tree(path, max_depth)  # what the disk allocated, as a later squash's budget
        except BaseException:
            discard_tree(path)
            raise
        layer = self.adopt(layer_id, path, usage)
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
            if layer.view != layer.path:
                _mount.umount(layer.view, detach=True)
                discard_tree(layer.view)
            discard_tree(layer.path)

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
        discard_tree(self.dir)
        if self.cgroups is not None:
            self.cgroups.close()
        if self.ids is not None:
            self.ids.close()
        if self._views is not None:
            self._views.close()
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
        discard_tree(store_dir)
        raise SandboxUnavailable(
            f"cannot mount the sandbox's tmpfs/overlayfs workspaces ({e}); in a container, run it with "
            "CAP_SYS_ADMIN (e.g. docker --privileged) or run on the host as root"
        ) from e
    _mount.umount_tree(probe)
    discard_tree(probe)


_STORE_DIR_RE = re.compile(r"^(.*/(\d+)-[0-9a-f]{8})/[EL]/")
# layers' idmapped views: the store's (V/<layer>) and each environment's own (E/<env>/v/<layer>)
_VIEW_RE = re.compile(r"^(.*/(\d+)-[0-9a-f]{8})/(?:V|E/[0-9a-f]{12}/v)/[0-9a-f]{12}$")


def _reap_stale(root: str) -> None:
    """Remove store directories (and their mounts) left by processes that no longer exist:
    every store under ``root``, and any store elsewhere that still has sandbox mounts."""
    stale = set()
    for name in os.listdir(root):
        pid_text = name.split("-", 1)[0]
        if pid_text.isdigit() and not os.path.exists(f"/proc/{pid_text}"):
            stale.add(os.path.join(root, name))
    # environments' mounts (source asyncrl-*) and layers' idmapped views (source: the disk)
    sandbox_mounts = [(_STORE_DIR_RE, p) for p in _mount.mounts_with_source_prefix("asyncrl-")]
    views = [(_VIEW_RE, p) for p in _mount.mounts_with_source_prefix("")]
    for pattern, point in sandbox_mounts + views:
        match = pattern.match(point)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            stale.add(match.group(1))
    for path in sorted(stale):
        _mount.umount_tree(path)
        if not _mount.mounts_under(path):
            discard_tree(path)
        log.warning("sandbox_stale_store_reaped", dir=path)
