"""Environment: an overlayfs workspace whose commands run under bubblewrap.

Host layout of one environment (``<store>/E/<id>``, all under a root-only store directory)::

    rw/       tmpfs (size = limits.disk_bytes): upper/ work/ tmp/ shm/
    v/        read-only idmapped views of the snapshot's layers, showing them as the environment's uid
    merged/   overlayfs: lower = those views, upper = rw/upper

Each command is a fresh ``bwrap``, forked by the environment's spawner thread so that it is born
in the environment's memory cgroup (`sandbox._spawner`); the child drops to the environment's own
unprivileged host uid (`sandbox._ids`: the kernel's per-uid quotas are then the environment's own;
bwrap shows it inside as ``sandbox_uid``) and a fresh session keyring (`sandbox._child`) before it
executes bwrap, which unshares every namespace (no network, own pid/mount/ipc/uts/cgroup/user
namespaces), forbids further user namespaces (``--disable-userns``), binds ``merged`` at the
workspace, the host's /usr read-only, a synthetic /etc, a read-only /proc/sys, and /tmp and
/dev/shm from the size-capped tmpfs, and loads the seccomp filter (`sandbox._seccomp`) before
executing the sandbox's init: tini, from a copy nobody inside may read, so pid 1 is not dumpable.
Limits are set inside with ``ulimit`` after the user namespace exists (and each environment has
its own host uid), so the process count is per environment. The wall clock kills the init through
a pidfd; its pid namespace takes every remaining process (daemons included) down with it.

What the sandbox leaves on the host is budgeted there, not only inside: a snapshot copies holes
as holes and hard links as links and stops with `SandboxViolation` past ``limits.disk_bytes``,
``limits.num_inodes`` or ``limits.max_dir_depth``; every host walk of a workspace is iterative.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from sandbox import _mount, _seccomp
from sandbox._cgroup import EnvCgroup
from sandbox._child import child_setup
from sandbox._host import GRADER_NAME, INIT_NAME, system_binds
from sandbox._ids import EnvIds
from sandbox._process import CommandPipes, RunningCommand, ulimit_prelude
from sandbox._spawner import SpawnedProcess, Spawner
from sandbox._tree import TreeBudget, copy_tree, discard_tree, remove_entry
from sandbox.config import SandboxLimits
from sandbox.errors import SandboxStateError, SandboxViolation
from sandbox.layers import Layer, LayerStore, Snapshot

__all__ = ["GRADER_PATH", "CommandResult", "Environment"]

log = structlog.get_logger(__name__)

GRADER_PATH = "/opt/asyncrl/" + GRADER_NAME
INIT_PATH = "/opt/asyncrl/" + INIT_NAME
_BWRAP_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_INNER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "USER": "sandbox",
    "PYTHONDONTWRITEBYTECODE": "1",
}


@dataclass(frozen=True)
class CommandResult:
    """Outcome of one command. ``exit_code`` is negative (-signal) when killed from outside."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    duration_s: float


class Environment:
    """An isolated workspace; create with `create` or `fork`, always `close` (or use ``with``)."""

    def __init__(self, store: LayerStore, layers: tuple[Layer, ...], limits: SandboxLimits) -> None:
        if store.closed:
            raise SandboxStateError(f"LayerStore {store.dir} is closed; expected open to make an environment")
        self.store = store
        self.limits = limits
        self.id = secrets.token_hex(6)
        self.dir = os.path.join(store.envs_dir, self.id)
        self._rw = os.path.join(self.dir, "rw")
        self._upper = os.path.join(self._rw, "upper")
        self._work = os.path.join(self._rw, "work")
        self.workspace_path = os.path.join(self.dir, "merged")
        self._layers = layers
        self._procs: set[RunningCommand] = set()
        self._lingering: set[RunningCommand] = set()  # killed, but their init did not exit in time
        self._num_starting = 0
        self._endings: set[asyncio.Task[None]] = set()  # ending commands whose run() was cancelled while forking
        self._settled = asyncio.Event()  # set whenever a command stops starting or running: `wait_idle` looks again
        self._closed = False
        self._cgroup: EnvCgroup | None = None
        self._spawner: Spawner | None = None
        self._ids: EnvIds | None = None
        self._views_dir = os.path.join(self.dir, "v")
        self._mounted_views: dict[str, str] = {}  # layer id -> this environment's view of it
        store.retain(layers)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- construction --------------------------------------------------------------------
    @classmethod
    def create(
        cls, store: LayerStore, files: Mapping[str, str | bytes] | None = None, limits: SandboxLimits | None = None
    ) -> Environment:
        """A new environment whose workspace holds ``files`` (path -> content) in a read-only base layer."""
        layer = store.layer_from_files(dict(files or {}))
        return cls(store, (layer,), limits or SandboxLimits())

    @classmethod
    def fork(cls, snapshot: Snapshot, limits: SandboxLimits | None = None) -> Environment:
        """A new environment seeing ``snapshot``'s files; O(1): mounts, copies nothing."""
        if snapshot.released:
            raise SandboxStateError(f"{snapshot!r} was released; expected a live snapshot to fork")
        return cls(snapshot.store, snapshot.layers, limits or SandboxLimits())

    @property
    def uid(self) -> int:
        """The host uid this environment's commands run as (and own their files as, on the host)."""
        assert self._ids is not None
        return self._ids.uid

    @property
    def gid(self) -> int:
        assert self._ids is not None
        return self._ids.gid

    def _setup(self) -> None:
        self._ids = self.store.acquire_ids()
        os.mkdir(self.dir, 0o711)
        os.mkdir(self._rw, 0o711)
        os.mkdir(self._views_dir, 0o700)
        os.mkdir(self.workspace_path, 0o755)
        lim = self.limits
        _mount.mount(
            "asyncrl-rw",
            self._rw,
            "tmpfs",
            _mount.MS_NOSUID | _mount.MS_NODEV,
            f"size={lim.disk_bytes},nr_inodes={lim.num_inodes},mode=0711",
        )
        uid, gid = self.uid, self.gid
        for name, mode, owner in (("upper", 0o755, uid), ("work", 0o700, 0), ("tmp", 0o700, uid), ("shm", 0o700, uid)):
            path = os.path.join(self._rw, name)
            os.mkdir(path, mode)
            os.chown(path, owner, gid if owner else 0)
        self._mount_overlay()
        if self.store.cgroups is not None:
            self._cgroup, self._spawner = self.store.cgroups.acquire(
                lim.total_memory_bytes, f"{self.store.name}-{self.id}"
            )
        else:
            self._spawner = Spawner(None)

    def _view(self, layer: Layer) -> str:
        """This environment's view of ``layer`` (mounted on first use), or the store's without ids of its own."""
        assert self._ids is not None
        if self._ids.views is None:
            return layer.view
        view = self._mounted_views.get(layer.id)
        if view is None:
            view = os.path.join(self._views_dir, layer.id)
            os.mkdir(view, 0o700)
            try:
                self._ids.views.mount(layer.path, view)
            except BaseException:
                os.rmdir(view)
                raise
            self._mounted_views[layer.id] = view
        return view

    def _drop_views(self, layers: tuple[Layer, ...]) -> None:
        """Unmount the views of layers this environment no longer stacks (its overlay is unmounted)."""
        keep = {layer.id for layer in self._layers}
        for layer in layers:
            view = self._mounted_views.pop(layer.id, None) if layer.id not in keep else None
            if view is not None:
                _mount.umount(view)
                os.rmdir(view)

    def _mount_overlay(self) -> None:
        lower = ":".join(self._view(layer) for layer in self._layers)
        _mount.mount(
            "asyncrl-ws",
            self.workspace_path,
            "overlay",
            _mount.MS_NOSUID | _mount.MS_NODEV,
            f"lowerdir={lower},upperdir={self._upper},workdir={self._work},index=off,redirect_dir=off,metacopy=off",
        )

    # -- commands ------------------------------------------------------------------------
    def _argv(self, cmd: str, extra_binds: tuple[tuple[str, str], ...], info_fd: int, seccomp_fd: int) -> list[str]:
        cfg = self.store.config
        argv = [self.store.bwrap_path, "--unshare-all", "--unshare-user", "--disable-userns"]
        # every environment sees itself as the same user, whatever its host uid
        argv += ["--uid", str(cfg.sandbox_uid), "--gid", str(cfg.sandbox_gid)]
        argv += ["--die-with-parent", "--new-session", "--clearenv", "--as-pid-1"]
        argv += ["--info-fd", str(info_fd), "--seccomp", str(seccomp_fd)]
        for key, value in _INNER_ENV.items():
            argv += ["--setenv", key, value]
        argv += system_binds(self.store.static_dir)
        # bwrap covers /proc/sys only where the caller could write it; cover it always (sysctls
        # read through it are still the sandbox's own namespaces')
        argv += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"]
        argv += ["--bind", os.path.join(self._rw, "shm"), "/dev/shm", "--remount-ro", "/dev"]
        argv += ["--bind", os.path.join(self._rw, "tmp"), "/tmp"]
        argv += ["--bind", self.workspace_path, cfg.workspace_dir]
        argv += ["--ro-bind", os.path.join(self.store.static_dir, GRADER_NAME), GRADER_PATH]
        argv += ["--ro-bind", os.path.join(self.store.static_dir, INIT_NAME), INIT_PATH]
        for src, dst in extra_binds:
            argv += ["--ro-bind", src, dst]
        argv += ["--remount-ro", "/", "--hostname", "sandbox", "--chdir", cfg.workspace_dir]
        argv += ["--", INIT_PATH, "-s", "--", cfg.shell, "-c", ulimit_prelude(self.limits) + cmd]
        return argv

    async def run(
        self,
        cmd: str,
        timeout_s: float | None = None,
        *,
        stdin: bytes | None = None,
        extra_ro_binds: tuple[tuple[str, str], ...] = (),
    ) -> CommandResult:
        """Run ``cmd`` with the shell inside the sandbox.

        Args:
            cmd: shell command line.
            timeout_s: wall-clock limit (default ``limits.wall_time_s``); on expiry the whole
                process tree is killed and ``timed_out`` is set.
            stdin: bytes fed to the command's stdin (default: /dev/null).
            extra_ro_binds: (host path, sandbox path) pairs bound read-only.

        Raises:
            SandboxStateError: the environment is closed.
            ValueError: ``timeout_s`` is not positive.
        """
        self._check_open()
        timeout = self.limits.wall_time_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        start = time.monotonic()
        self._num_starting += 1  # busy from the call on, not only once bwrap exists
        try:
            running = await self._spawn(cmd, extra_ro_binds, stdin)
        finally:
            self._num_starting -= 1
            self._settled.set()
        if self._closed:  # closed while it started: it must not outlive the environment
            running.kill()
        proc, out, err = running.proc, running.pipes.stdout, running.pipes.stderr
        timed_out = False
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(running.pipes.wait(), proc.wait())
        except TimeoutError:
            timed_out = True
        finally:
            running.kill()  # synchronous, so it happens even if we are being cancelled
            await asyncio.shield(self._finish(running))
        result = CommandResult(
            exit_code=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
            stdout=out.data.decode("utf-8", "replace"),
            stderr=err.data.decode("utf-8", "replace"),
            truncated=out.truncated or err.truncated,
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
        )
        log.debug("sandbox_command", env=self.id, exit_code=result.exit_code, timed_out=timed_out)
        return result

    async def _finish(self, running: RunningCommand) -> None:
        try:
            emptied = await running.terminate()
        finally:
            self._procs.discard(running)
            self._settled.set()
        if emptied:
            running.close()
            return
        self._lingering.add(running)
        log.error("sandbox_process_lingering", env=self.id, note="init did not exit after SIGKILL")

    def _num_busy(self) -> int:
        """Commands starting, running, or killed with processes possibly still alive."""
        for running in list(self._lingering):
            if running.init_exited():
                self._lingering.discard(running)
                running.close()
        return self._num_starting + len(self._procs) + len(self._lingering)

    def _check_quiescent(self, action: str) -> None:
        """Refuse ``action`` while any command runs or any killed one may still have processes."""
        if busy := self._num_busy():
            raise SandboxStateError(f"Environment {self.id} has {busy} running command(s); expected idle to {action}")

    async def wait_idle(self, timeout_s: float) -> None:
        """Until no command starts, runs, or lingers after its kill: then `snapshot` is allowed.

        A cancelled `run` returns before its sandbox is gone (the kill and the reap go on behind
        it, and a start cancelled mid-fork ends once the fork returns); this is the wait for that.

        Raises:
            TimeoutError: still busy after ``timeout_s`` (a killed sandbox that does not die
                stays busy; see `snapshot`).
            SandboxStateError: the environment is closed.
        """
        self._check_open()
        async with asyncio.timeout(timeout_s):
            while self._num_busy():
                if self._num_starting or self._procs:
                    self._settled.clear()
                    await self._settled.wait()
                else:  # only killed ones that outlived their reap: their inits' exits
                    await asyncio.gather(*(running.wait_init_exit() for running in self._lingering))

    async def _spawn(
        self, cmd: str, extra_ro_binds: tuple[tuple[str, str], ...], stdin: bytes | None
    ) -> RunningCommand:
        assert self._spawner is not None
        cgroup_procs = None  # born in the cgroup when forked by the spawner thread placed in it
        if self._cgroup is not None and not await self._spawner.in_cgroup():
            cgroup_procs = self._cgroup.procs_path
        pipes = CommandPipes(self.limits.output_bytes, stdin)
        try:
            seccomp_fd = _seccomp.filter_fd()
            try:
                argv = self._argv(cmd, extra_ro_binds, info_fd=pipes.info.child_fd, seccomp_fd=seccomp_fd)
                preexec_fn = child_setup(self.uid, self.gid, cgroup_procs)
            except BaseException:
                os.close(seccomp_fd)
                raise
            proc = await self._spawner.spawn(  # owns the child's ends from the call on
                argv,
                stdin=pipes.stdin.take_child_fd() if pipes.stdin is not None else None,
                stdout=pipes.stdout.take_child_fd(),
                stderr=pipes.stderr.take_child_fd(),
                env=_BWRAP_ENV,
                preexec_fn=preexec_fn,
                pass_fds=(pipes.info.take_child_fd(), seccomp_fd),  # bwrap reports its init's pid on info
                on_abandoned=functools.partial(self._end_abandoned, pipes),
            )
        except asyncio.CancelledError:  # still starting until the fork returns (`_end_abandoned`)
            self._num_starting += 1
            raise
        except BaseException:
            pipes.close()
            raise
        running = RunningCommand(proc, pipes)
        self._procs.add(running)
        return running

    def _end_abandoned(self, pipes: CommandPipes, proc: SpawnedProcess | None) -> None:
        """End what a fork started for a run() cancelled meanwhile, as any killed command ends."""
        self._num_starting -= 1
        self._settled.set()
        if proc is None:
            pipes.close()
            return
        running = RunningCommand(proc, pipes)
        self._procs.add(running)
        running.kill()
        ending = asyncio.get_running_loop().create_task(self._finish(running))
        self._endings.add(ending)
        ending.add_done_callback(self._endings.discard)

    @property
    def num_running(self) -> int:
        return len(self._procs)

    # -- snapshot ------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Freeze the workspace into a new read-only layer (cost ~ bytes changed since the last one).

        The environment continues on top of the new layer. Stacks deeper than
        ``config.max_layer_depth`` are squashed into one layer.

        Raises:
            SandboxStateError: closed, or a command is still running.
            SandboxViolation: the workspace's changes exceed ``limits.disk_bytes``,
                ``limits.num_inodes`` or ``limits.max_dir_depth`` on the host (nothing is kept
                of the attempt; the environment goes on unchanged).
        """
        self._check_open()
        self._check_quiescent("snapshot")
        _mount.umount(self.workspace_path)
        try:
            if os.listdir(self._upper):
                lim = self.limits
                budget = TreeBudget(lim.disk_bytes, lim.num_inodes, lim.max_dir_depth)
                layer = self._build_layer(self._upper, budget, keep_whiteouts=True, what="snapshot")
                self._replace_layers((layer, *self._layers))
                self._reset_upper()
            if len(self._layers) > self.store.config.max_layer_depth:
                self._replace_layers((self._squash(),))
            return Snapshot(self.store, self._layers)
        finally:
            self._mount_overlay()

    def _replace_layers(self, layers: tuple[Layer, ...]) -> None:
        self.store.retain(layers)
        old, self._layers = self._layers, layers
        try:
            self._drop_views(old)
        finally:
            self.store.release(old)

    def _build_layer(self, src: str, budget: TreeBudget, *, keep_whiteouts: bool, what: str) -> Layer:
        layer_id, path = self.store.new_layer_dir()
        try:
            usage = copy_tree(
                src, path, keep_whiteouts=keep_whiteouts, budget=budget, owner=self.store.layer_owner, what=what
            )
        except SandboxViolation as e:
            discard_tree(path)
            log.warning("sandbox_budget_exceeded", env=self.id, what=what, reason=str(e))
            raise
        except BaseException:
            discard_tree(path)
            raise
        return self.store.adopt(layer_id, path, usage)

    def _reset_upper(self) -> None:
        for path, mode, uid in ((self._upper, 0o755, self.uid), (self._work, 0o700, 0)):
            parent_fd = os.open(self._rw, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                remove_entry(parent_fd, os.path.basename(path))
            finally:
                os.close(parent_fd)
            os.mkdir(path, mode)
            os.chown(path, uid, self.gid if uid else 0)

    def _squash(self) -> Layer:
        point = os.path.join(self.dir, "squash")
        os.mkdir(point, 0o700)
        lower = ":".join(layer.view for layer in self._layers)
        # the merged view holds no more than its layers together
        budget = TreeBudget(
            max_bytes=sum(layer.usage.num_bytes for layer in self._layers),
            max_inodes=sum(layer.usage.num_inodes for layer in self._layers),
            max_depth=max(self.limits.max_dir_depth, *(layer.usage.depth for layer in self._layers)),
        )
        _mount.mount("asyncrl-squash", point, "overlay", _mount.MS_RDONLY, f"lowerdir={lower}")
        try:
            layer = self._build_layer(point, budget, keep_whiteouts=False, what="squash")
        finally:
            _mount.umount(point)
            os.rmdir(point)
        log.info("sandbox_layers_squashed", env=self.id, depth=len(self._layers))
        return layer

    # -- lifecycle -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxStateError(f"Environment {self.id} is closed; expected open")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def depth(self) -> int:
        return len(self._layers)

    def close(self) -> None:
        """Kill every running command, unmount and delete the environment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for running in list(self._procs | self._lingering):
            running.kill()
        lingering, self._lingering = list(self._lingering), set()
        # its uid is reused once all its processes are gone; with one that outlived its kill, never
        ids_settled = None if lingering else self._all_processes_gone
        try:
            with contextlib.ExitStack() as releases:  # each released, a failure raised after the others
                for running in lingering:
                    releases.callback(running.close)
        finally:
            _mount.umount_tree(self.dir)
            discard_tree(self.dir)
            if self._cgroup is not None and self._spawner is not None and self.store.cgroups is not None:
                self.store.cgroups.release(self._cgroup, self._spawner)
            elif self._spawner is not None:
                self._spawner.close()
            if self._ids is not None and self.store.ids is not None:
                self.store.ids.release(self._ids, ids_settled)
            self.store.release(self._layers)

    def _all_processes_gone(self) -> bool:
        """After `close`: no command starting, and every one's pid namespace known empty."""
        return self._num_busy() == 0

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
