"""Each environment runs as its own host uid: what the kernel counts per uid (inotify instances,
fds in flight over unix sockets, POSIX message queue bytes, pipe buffer pages) one environment
exhausts is still whole for the next. Run against environments sharing one uid too, where the
attack must work, so the assertions are about the per-environment uids."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os

import pytest

from sandbox import Environment, LayerStore, SandboxLimits, SandboxUnavailable
from sandbox._ids import IdPool
from tests.waiting import until

from .conftest import ENV_UID_BASE, ENV_UID_COUNT, TEST_CONFIG, sandbox_pids

pytestmark = pytest.mark.usefixtures("host_unchanged")

# One process per quota (each has only `num_open_files` fds): takes all of it, reports what it
# holds in the workspace, and keeps it until killed.
_HOLD = r"""
import ctypes, errno, fcntl, json, os, signal, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
kind, held, err = sys.argv[1], 0, None
keep = []
if kind == "inotify":
    while (fd := libc.inotify_init1(os.O_CLOEXEC)) >= 0:
        keep.append(fd); held += 1
    err = ctypes.get_errno()
elif kind == "inflight":
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    r, w = os.pipe()
    try:
        while True:
            socket.send_fds(a, [b"x"], [r] * 250); held += 250
    except OSError as e:
        err = e.errno
    keep += [a, b]
elif kind == "mqueue":
    class Attr(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                    ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(Attr)]
    while libc.mq_open(f"/q{held}".encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(Attr(0, 10, 8192, 0))) >= 0:
        held += 1
    err = ctypes.get_errno()
elif kind == "pipes":
    try:
        while True:
            r, w = os.pipe()
            fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 1 << 20)
            os.close(w); keep.append(r); held += 1
    except OSError as e:
        err = e.errno
    for _ in range(32):  # past the soft limit: the uid's next pipes get 2 pages
        r, w = os.pipe()
        os.close(w); keep.append(r)
with open(f"held-{kind}.json", "w") as f:
    json.dump({"held": held, "stopped_by": errno.errorcode.get(err, str(err))}, f)
signal.pause()
"""
_KINDS = ("inotify", "inflight", "mqueue", "pipes")

# One of each, as a fresh command of another environment takes it
_PROBE = r"""
import ctypes, errno, fcntl, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
name = lambda: errno.errorcode[ctypes.get_errno()]
out = {}
out["inotify"] = "ok" if libc.inotify_init1(0) >= 0 else name()
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    socket.send_fds(a, [b"x"], [0]); out["inflight"] = "ok"
except OSError as e:
    out["inflight"] = errno.errorcode[e.errno]
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(Attr)]
ok = libc.mq_open(b"/mine", os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(Attr(0, 10, 8192, 0))) >= 0
out["mqueue"] = "ok" if ok else name()
r, w = os.pipe()
out["pipe_size"] = fcntl.fcntl(r, fcntl.F_GETPIPE_SZ)
try:
    fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 1 << 20); out["pipes"] = "ok"
except OSError as e:
    out["pipes"] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
_WHOLE = {"inotify": "ok", "inflight": "ok", "mqueue": "ok", "pipe_size": 65536, "pipes": "ok"}


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


async def _probe_beside_a_hog(store: LayerStore) -> tuple[dict[str, dict[str, object]], dict[str, object], int, int]:
    """What environment A took of each quota, what B then got, and both host uids."""
    limits = SandboxLimits(wall_time_s=120.0)
    with Environment.create(store, {}, limits) as hog, Environment.create(store, {}, limits) as other:
        holders = " & ".join(f"python3 -c {_quote(_HOLD)} {kind}" for kind in _KINDS)
        holding = asyncio.create_task(hog.run(f"{holders} & wait"))
        try:
            paths = [os.path.join(hog.workspace_path, f"held-{kind}.json") for kind in _KINDS]
            await until(lambda: all(os.path.exists(p) and os.path.getsize(p) for p in paths), 60, "A holding")
            held = {}
            for kind, path in zip(_KINDS, paths, strict=True):
                with open(path, encoding="utf-8") as f:
                    held[kind] = json.load(f)
            result = await other.run(f"python3 -c {_quote(_PROBE)}")
            assert result.exit_code == 0, result.stderr
            return held, json.loads(result.stdout), hog.uid, other.uid
        finally:
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding


async def test_one_environment_exhausting_per_uid_quotas_leaves_the_next_whole(store: LayerStore) -> None:
    held, seen, uid_a, uid_b = await _probe_beside_a_hog(store)
    assert held["inotify"]["stopped_by"] == "EMFILE"  # A holds all of each ...
    assert held["inflight"]["stopped_by"] == "ETOOMANYREFS" and held["inflight"]["held"] >= 250
    assert held["mqueue"]["stopped_by"] == "EMFILE" and held["mqueue"]["held"] >= 5
    assert held["pipes"]["stopped_by"] == "EPERM" and held["pipes"]["held"] >= 60
    assert seen == _WHOLE  # ... and B has each whole meanwhile
    assert uid_a != uid_b

    # the control: environments sharing one uid (as before), where B finds A's exhaustion
    shared = LayerStore(dataclasses.replace(TEST_CONFIG, env_uid_count=0))
    try:
        _, starved, uid_a, uid_b = await _probe_beside_a_hog(shared)
    finally:
        shared.close()
    assert uid_a == uid_b == TEST_CONFIG.sandbox_uid
    assert starved == {"inotify": "EMFILE", "inflight": "ETOOMANYREFS", "mqueue": "EMFILE", "pipe_size": 8192,
                       "pipes": "EPERM"}  # fmt: skip


async def test_ids_are_recycled_only_once_the_environment_s_processes_are_gone(store: LayerStore) -> None:
    assert store.ids is not None
    env = Environment.create(store, {})
    uid = env.uid
    assert ENV_UID_BASE <= uid < ENV_UID_BASE + ENV_UID_COUNT
    running = asyncio.create_task(env.run("sleep 60", timeout_s=90))
    await until(lambda: any(_uid_of(pid) == uid for pid in sandbox_pids()), 30, "the command running as its uid")
    env.close()  # kills it; its reap goes on behind the close
    taken = [Environment.create(store, {}) for _ in range(3)]
    try:
        assert uid not in {e.uid for e in taken}  # not while its processes may live, nor while it rests
        with contextlib.suppress(asyncio.CancelledError):
            await running
        assert not any(_uid_of(pid) == uid for pid in sandbox_pids())
    finally:
        for e in taken:
            e.close()


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def test_pool_reuses_rested_ids_oldest_first_and_never_shares_one_between_stores() -> None:
    config = dataclasses.replace(TEST_CONFIG, env_uid_count=3, env_uid_quarantine_s=0.0)
    one, two = IdPool(config), IdPool(config)
    try:
        a = one.acquire()
        b = two.acquire()  # the other store skips what the first holds ...
        assert b.uid == a.uid + 1
        c = one.acquire()
        assert c.uid == a.uid + 2
        busy = [True]
        one.release(a, lambda: not busy[0])
        one.release(c, lambda: True)
        assert one.acquire().uid == c.uid  # ... a settled one comes back; a still-busy one does not
        with pytest.raises(SandboxUnavailable, match="env_uid_count"):
            one.acquire()
        busy[0] = False
        assert one.acquire().uid == a.uid
        assert all(v.uid != b.uid for v in (a, c))
    finally:
        one.close()
        two.close()
