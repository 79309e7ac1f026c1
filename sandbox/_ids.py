"""One host uid and gid per live environment, taken from a configured range and recycled when clean.

The kernel counts several resources per host uid whatever the namespaces: inotify instances and
watches, epoll watches, file descriptors in flight over unix sockets, POSIX message queue bytes,
pipe buffer pages, pending signals, locked memory, user namespaces created, processes (at the host
level of RLIMIT_NPROC), keys and keyring bytes. Under one shared uid, an environment holding them
starves every other (EMFILE, ETOOMANYREFS, pipes of 8 KiB that cannot grow). So each environment
runs as its own host uid, ``SandboxConfig.env_uid_base`` + n (its gid the same number), and those
quotas are its own. Inside, every environment looks the same: bwrap maps the configured
``sandbox_uid``/``sandbox_gid`` to the environment's ids, and overlayfs reads the layers (root's on
disk) through idmapped views that show them as the environment's (one user namespace per uid,
kept with the uid for its next environment: making one forks a placeholder process).

Every store (process) on one host shares the range, whatever its ``root_dir`` (actor kinds and runs
each use their own): the kernel's quotas are per host uid. So the claims are one file per host,
``SandboxConfig.env_uid_claims`` (``/run/asyncrl-sandbox/env-uids.lock``): a uid is taken by locking
its byte (an open-file-description lock: the kernel drops it when the store's process ends, however
it ends, kill -9 included), and a store keeps the locks of every uid it has handed out until it
closes, so no two stores ever run environments as the same uid. The file and its directory must be
this user's and closed to others (made 0700/0600, opened without following links): anyone who can
open the file can lock bytes of it, and anyone who can swap it splits the stores' claims. Another
user's file there is refused, not worked around: a second record would hand out the same uids.

Each byte's content says whether the uid ever ran an environment (1) or has rested since (0): a
store that dies, or closes before its last environments' ids have rested, leaves 1s, and the store
that claims such a uid next rests it ``env_uid_quarantine_s`` before handing it out, since nobody
knows when it was freed. A store writes 0 for the uids it rested fully when it closes. (The file is
sparse: its size is the highest uid, its disk a page per 4096 uids ever used.)

Recycling: an environment's ids come back only once it is closed and all its processes are known
gone (each command's pid namespace emptied: its init exited, which the kernel allows only after
every other process in it is reaped, and its bwrap reaped); then they rest ``env_uid_quarantine_s``
(what the kernel frees after the processes, an IPC namespace's queues or sockets in flight, it frees
in deferred work) and the oldest rested ids are handed out first. An environment whose processes
may outlive their kill retires its ids for the store's lifetime. No host file keeps an
environment's uid past its close: its writable layer is its own tmpfs, unmounted then, and
snapshots and imports are written as root's.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import grp
import os
import pwd
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from sandbox._idmap import IdmappedViews
from sandbox.config import SandboxConfig
from sandbox.errors import SandboxUnavailable

__all__ = ["EnvIds", "IdPool", "check_range_is_free", "open_claims"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EnvIds:
    """An environment's host uid and gid, and the idmapped views showing layers as theirs (None:
    the store has none, and ``uid`` is the shared ``sandbox_uid``)."""

    uid: int
    gid: int
    views: IdmappedViews | None


def _subordinate_ranges(path: str) -> list[tuple[str, int, int]]:
    ranges = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                fields = line.strip().split(":")
                if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                    ranges.append((fields[0], int(fields[1]), int(fields[2])))
    except FileNotFoundError:
        pass
    return ranges


def check_range_is_free(config: SandboxConfig) -> None:
    """Refuse a uid range that holds a user or group of this host, or overlaps its subordinate ids.

    Raises:
        SandboxUnavailable: naming the conflict and the setting to change.
    """
    low, high = config.env_uid_base, config.env_uid_base + config.env_uid_count
    conflicts = [f"user {u.pw_name} ({u.pw_uid})" for u in pwd.getpwall() if low <= u.pw_uid < high]
    conflicts += [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if low <= g.gr_gid < high]
    for path in ("/etc/subuid", "/etc/subgid"):
        for owner, start, count in _subordinate_ranges(path):
            if start < high and low < start + count:
                conflicts.append(f"{path} range of {owner} ({start}+{count})")
    if conflicts:
        raise SandboxUnavailable(
            f"SandboxConfig.env_uid_base={config.env_uid_base} with env_uid_count={config.env_uid_count} "
            f"overlaps ids this host uses: {', '.join(conflicts[:5])}; choose a range no user, group or "
            "subordinate id range holds"
        )


def _refuse(path: str, why: str) -> SandboxUnavailable:
    log.error("sandbox_uid_claims_refused", path=path, reason=why)
    return SandboxUnavailable(
        f"the host's environment uid claims {path!r}: {why}; remove it if it is not this project's, or set "
        "SandboxConfig.env_uid_claims to a path only this user can reach, the same for every store of the host"
    )


def _check_private(path: str, fd: int, kind: str, mode_mask: int) -> None:
    st = os.fstat(fd)
    euid = os.geteuid()
    if st.st_uid != euid:
        raise _refuse(path, f"the {kind} belongs to uid {st.st_uid}, not this process's {euid} (another user's "
                            "claims: stores of two users would hand out the same uids; run every store as one user)")
    if st.st_mode & mode_mask:
        raise _refuse(path, f"the {kind} has mode {stat.S_IMODE(st.st_mode):o}: other users could reach it")


def open_claims(path: str) -> int:
    """Open (creating it, and its directory, if missing) the host's uid claim file; returns its fd.

    The directory is made 0700 and the file 0600; neither is followed if it is a link, and both must
    be this process's user's and closed to other users, so that no one else can lock a uid's byte or
    put their own file in its place.

    Raises:
        SandboxUnavailable: the path is a link, not a directory / regular file, another user's or open
            to others, or cannot be made.
    """
    directory, name = os.path.split(path)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise _refuse(path, f"cannot make its directory ({e.strerror})") from e
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, f"its directory {directory!r} is a symbolic link or not a directory") from e
        raise _refuse(path, f"cannot open its directory ({e.strerror})") from e
    try:
        _check_private(path, dir_fd, "directory", 0o022)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refuse(path, "it is a symbolic link") from e
            raise _refuse(path, f"cannot open it ({e.strerror})") from e
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refuse(path, "it is not a regular file")
        _check_private(path, fd, "file", 0o077)
    except BaseException:
        os.close(fd)
        raise
    return fd


class IdPool:
    """Hands each environment its own ids from the configured range (see the module's text)."""

    def __init__(self, config: SandboxConfig) -> None:
        self._base, self._count = config.env_uid_base, config.env_uid_count
        self._quarantine_s = config.env_uid_quarantine_s
        self._next = 0  # offsets below it have been tried: claimed here, or skipped (see _skipped)
        self._views: dict[int, IdmappedViews] = {}  # per uid, kept for its reuse
        self._resting: collections.deque[tuple[float, int]] = collections.deque()  # (freed at, uid), oldest first
        self._pending: list[tuple[int, Callable[[], bool]]] = []  # closed, processes not yet known gone
        self._in_use: set[int] = set()
        self._skipped: list[int] = []  # other stores held them when tried (they may have died since)
        self._retired: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._lock_fd = open_claims(config.env_uid_claims)

    def _claim(self, uid: int) -> bool:
        """Lock ``uid``'s byte of the host's claim file; False if another store holds it."""
        flock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, uid, 1, 0)  # struct flock, l_pid 0
        try:
            fcntl.fcntl(self._lock_fd, fcntl.F_OFD_SETLK, flock)
        except BlockingIOError:
            return False
        return True

    def acquire(self) -> EnvIds:
        """Ids no live environment has.

        Raises:
            SandboxUnavailable: every id of the range is in use or retired.
        """
        with self._lock:
            if self._closed:
                raise SandboxUnavailable("the store's id pool is closed")
            self._collect_settled()
            uid = self._pick()
            self._in_use.add(uid)
        try:
            views = self._views.get(uid)
            if views is None:
                views = IdmappedViews.for_ids(uid, uid)
                self._views[uid] = views
        except BaseException:
            with self._lock:
                self._in_use.discard(uid)
                self._resting.appendleft((0.0, uid))
            raise
        return EnvIds(uid, uid, views)

    def _pick(self) -> int:
        retry: list[int] | None = None
        while True:
            now = time.monotonic()
            if self._resting and now - self._resting[0][0] >= self._quarantine_s:
                return self._resting.popleft()[1]
            if self._next < self._count:
                uid = self._base + self._next
                self._next += 1
            else:  # the range is used up here: try again, once per acquire, what other stores held then
                if retry is None:
                    retry, self._skipped = self._skipped, []
                if not retry:
                    break
                uid = retry.pop()
            if not self._claim(uid):
                self._skipped.append(uid)
                continue
            if os.pread(self._lock_fd, 1, uid) == b"\1":  # left unrested by a store that died or closed
                self._resting.append((now, uid))
                continue
            self._mark(uid, b"\1")  # before any environment runs as it
            return uid
        if self._resting:  # the range is too small for this churn: reuse early rather than fail
            freed_at, uid = self._resting.popleft()
            log.warning("sandbox_uid_reused_early", uid=uid, rested_s=round(now - freed_at, 3))
            return uid
        raise SandboxUnavailable(
            f"all {self._count} environment uids from {self._base} are in use ({len(self._in_use)} by this "
            f"store's environments, {len(self._pending)} closing, {len(self._retired)} retired, the rest by other "
            "stores on this host); raise SandboxConfig.env_uid_count or close environments"
        )

    def _collect_settled(self) -> None:
        still = []
        for uid, settled in self._pending:
            if settled():
                self._resting.append((time.monotonic(), uid))
            else:
                still.append((uid, settled))
        self._pending = still

    def release(self, ids: EnvIds, settled: Callable[[], bool] | None) -> None:
        """Take back a closed environment's ids: rested and reused once ``settled()`` says its
        processes are all gone (checked at later acquires); never reused if ``settled`` is None."""
        with self._lock:
            if ids.uid not in self._in_use:
                return
            self._in_use.discard(ids.uid)
            if settled is None:
                self._retired.add(ids.uid)
                log.warning("sandbox_uid_retired", uid=ids.uid, reason="processes may outlive the environment")
            else:
                self._pending.append((ids.uid, settled))

    def num_in_use(self) -> int:
        with self._lock:
            return len(self._in_use)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            views, self._views = list(self._views.values()), {}
            self._collect_settled()
            now = time.monotonic()
            rested = [uid for freed_at, uid in self._resting if now - freed_at >= self._quarantine_s]
        for v in views:
            v.close()
        for uid in rested:  # the next store may hand these out at once; the rest it rests first
            self._mark(uid, b"\0")
        os.close(self._lock_fd)  # every uid's lock with it

    def _mark(self, uid: int, value: bytes) -> None:
        """Record in ``uid``'s byte whether it needs a rest before its next store hands it out. A
        failed write (a full disk under the claims) costs only that rest, kept or skipped once, so
        it is logged, not raised: the uid's lock, what keeps stores apart, is held either way."""
        try:
            os.pwrite(self._lock_fd, value, uid)
        except OSError as e:
            log.error("sandbox_uid_claim_mark_failed", uid=uid, needs_rest=value == b"\1", error=str(e))
