"""The escape battery, second part: attacks on the kernel's shared state (keyrings, namespaces,
sysctls, the init, the layers on the host, pid reuse), each run twice: in an `Environment`, where
it must fail, and in a bare bwrap (`_bare.run_bare`), where it must work, so every assertion is
about the hardening and not about an attack that never worked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox import Environment, LayerStore, SandboxLimits, SandboxStateError
from sandbox._seccomp import DENIED_SYSCALLS, syscall_number
from tests.waiting import until

from ._bare import run_bare
from .conftest import SANDBOX_UID, TEST_ROOT, sandbox_pids

pytestmark = pytest.mark.usefixtures("host_unchanged")

REPO = Path(__file__).resolve().parents[2]

# A probe each sandbox runs with python3: the system calls an attacker would make, each reported
# as ok or with its errno (by name), never raising.
_SYSCALL_PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = json.loads(sys.argv[1])
def call(name, *args):
    r = libc.syscall(nr[name], *args)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
out = {}
pid = libc.syscall(nr["clone"], 0x10000000 | 17, None, None, None, None)  # CLONE_NEWUSER | SIGCHLD
if pid == 0:
    os._exit(0)
out["clone_newuser"] = "ok" if pid > 0 else errno.errorcode.get(ctypes.get_errno())
if pid > 0:
    os.waitpid(pid, 0)
out["unshare_user"] = call("unshare", 0x10000000)
out["unshare_net"] = call("unshare", 0x40000000)
out["keyctl_get_session"] = call("keyctl", 0, -3, 0)
out["add_key"] = call("add_key", b"user", b"planted", b"x", 1, -3)
out["bpf"] = call("bpf", 0, None, 0)
out["perf_event_open"] = call("perf_event_open", None, 0, -1, -1, 0)
out["userfaultfd"] = call("userfaultfd", 0)
out["io_uring_setup"] = call("io_uring_setup", 1, None)
out["mount"] = call("mount", b"none", b"/tmp", b"tmpfs", 0, None)
out["ptrace_traceme"] = call("ptrace", 0, 0, None, None)
print(json.dumps(out))
"""
_PROBED = (
    "unshare", "keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "mount", "ptrace",
    "clone",
)  # fmt: skip


def _probe_cmd() -> str:
    numbers = json.dumps({name: syscall_number(name) for name in _PROBED})
    return f"python3 -c {_quote(_SYSCALL_PROBE)} {_quote(numbers)}"


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


async def test_seccomp_refuses_what_the_bare_sandbox_allows(store: LayerStore, tight: SandboxLimits) -> None:
    rc, out, err = await run_bare(store, _probe_cmd())
    assert rc == 0, err
    control = json.loads(out)
    with Environment.create(store, {}, tight) as env:
        result = await env.run(_probe_cmd())
    assert result.exit_code == 0, result.stderr
    hardened = json.loads(result.stdout)
    # without the filter, a sandbox makes user and network namespaces and reaches the keyrings
    for name in ("unshare_user", "unshare_net", "clone_newuser", "keyctl_get_session", "add_key"):
        assert control[name] == "ok", (name, control)
    for name, outcome in hardened.items():
        assert outcome == "EPERM", (name, hardened)


async def test_no_nested_user_namespace_mount_or_sysctl(store: LayerStore, tight: SandboxLimits) -> None:
    attack = (
        "unshare -Urm sh -c 'mount -t tmpfs x /tmp && echo MOUNTED' 2>&1; "
        "unshare -Urn sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward && echo SYSCTL' 2>&1; "
        "unshare -Urm sh -c 'mount -t proc proc /proc && echo PROC' 2>&1; "
        "echo 1 > /proc/sys/kernel/hostname 2>/dev/null && echo HOSTNAME; "
        'awk \'$5 == "/proc/sys" {print "procsys", $6}\' /proc/self/mountinfo'
    )
    _, control, _ = await run_bare(store, attack)
    assert "MOUNTED" in control and "SYSCTL" in control  # the attack works ...
    with Environment.create(store, {}, tight) as env:
        result = await env.run(attack)
    for marker in ("MOUNTED", "SYSCTL", "PROC", "HOSTNAME"):  # ... and is stopped here
        assert marker not in result.stdout, result.stdout
    assert "procsys ro," in result.stdout  # /proc/sys is a read-only mount inside
    assert "procsys" not in control  # (bwrap alone leaves it as it is)


async def test_init_is_not_dumpable(store: LayerStore, tight: SandboxLimits) -> None:
    attack = "readlink /proc/1/exe && echo EXE; head -c 64 /proc/1/environ >/dev/null && echo ENVIRON; ps -o comm= -p 1"
    _, control, _ = await run_bare(store, attack)
    assert "EXE" in control and "ENVIRON" in control  # bwrap's own pid 1 can be read ...
    with Environment.create(store, {}, tight) as env:
        result = await env.run(attack)
    assert "EXE" not in result.stdout and "ENVIRON" not in result.stdout, result.stdout  # ... ours cannot
    assert "Permission denied" in result.stderr
    assert result.stdout.split()[-1] == "init"


_KEYRING_HOST = r"""
import asyncio, ctypes, json, subprocess, sys
from sandbox import Environment, LayerStore, SandboxConfig, SandboxLimits
from sandbox._child import child_setup
from sandbox._seccomp import syscall_number
from tests.sandbox._bare import run_bare
root, uid, probe = sys.argv[1], int(sys.argv[2]), sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# the host process has a (named) session keyring holding a secret, as after a login or any keyctl use
assert libc.syscall(syscall_number("keyctl"), 1, b"asyncrl-test-host-session") > 0
assert libc.syscall(syscall_number("add_key"), b"user", b"asyncrl-test-secret", b"hunter2", 7, -3) > 0
async def main():
    with LayerStore(SandboxConfig(root_dir=root, sandbox_uid=uid, sandbox_gid=uid)) as store:
        control = await run_bare(store, probe)
        with Environment.create(store, {}, SandboxLimits(wall_time_s=20.0)) as env:
            result = await env.run(probe)
    # the keyring layer alone (no seccomp, no namespaces): the sandbox uid's process on the host
    alone = subprocess.run(["/bin/sh", "-c", probe], preexec_fn=child_setup(uid, uid, None), capture_output=True,
                           text=True, env={"PATH": "/usr/bin:/bin"})
    print(json.dumps({"control": control[1], "hardened": result.stdout, "keyring_only": alone.stdout}))
asyncio.run(main())
"""

_KEYRING_PROBE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keyctl = int(sys.argv[1])
key = libc.syscall(keyctl, 10, -3, b"user", b"asyncrl-test-secret", 0)  # KEYCTL_SEARCH the session keyring
if key > 0:
    buf = ctypes.create_string_buffer(64)
    n = libc.syscall(keyctl, 11, key, buf, 64)  # KEYCTL_READ
    print("READ", buf.raw[:n].decode())
else:
    print("search refused", ctypes.get_errno())
"""


def test_host_keyrings_are_out_of_reach() -> None:
    probe = f"python3 -c {_quote(_KEYRING_PROBE)} {syscall_number('keyctl')}"
    # in a child process: joining a session keyring here would change this test process's own
    done = subprocess.run(
        [sys.executable, "-c", _KEYRING_HOST, TEST_ROOT, str(SANDBOX_UID), probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "READ hunter2" in seen["control"]  # the attack works bare ...
    assert "hunter2" not in seen["hardened"] and "search refused 1" in seen["hardened"]  # ... not here: EPERM,
    assert "search refused 126" in seen["keyring_only"]  # and without the filter, ENOKEY: a fresh keyring


async def test_layers_are_out_of_reach_of_the_sandbox_uid_on_the_host(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {"lib.py": "SAFE = True\n"}, tight) as env:
        await env.run("echo 'x = 1' > extra.py")
        snap = env.snapshot()
    with snap:
        layer = snap.layers[-1]
        on_disk, in_view = os.path.join(layer.path, "lib.py"), os.path.join(layer.view, "lib.py")
        if layer.view != layer.path:  # idmapped: root's on disk, the sandbox uid's through a read-only view
            assert os.stat(on_disk).st_uid == 0 and os.stat(in_view).st_uid == store.config.sandbox_uid
            with pytest.raises(OSError, match="Read-only file system"):
                open(in_view, "w").close()  # not even root writes through the view
        for target in (on_disk, in_view):  # and a host process of the sandbox uid reaches neither
            tamper = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", 'echo "SAFE = False" > "$0"', target,
                user=store.config.sandbox_uid,
                group=store.config.sandbox_gid,
                extra_groups=[],
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(tamper.communicate(), 30)
            assert tamper.returncode != 0 and b"Permission denied" in err, err
        with Environment.fork(snap, tight) as fork:
            edited = await fork.run("cat lib.py; echo 'SAFE = 2' > lib.py && cat lib.py && stat -c %u lib.py")
    assert edited.stdout.split() == ["SAFE", "=", "True", "SAFE", "=", "2", str(store.config.sandbox_uid)]


async def test_kills_go_through_pidfds_never_numeric_pids(
    store: LayerStore, tight: SandboxLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    numeric: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: numeric.append((pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda pid, sig: numeric.append((pid, sig)))
    with Environment.create(store, {}, tight.replace(wall_time_s=30.0)) as env:
        timed_out = await env.run("sleep 20 & sleep 30", timeout_s=0.5)
        task = asyncio.create_task(env.run("sleep 30"))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        finished = await env.run("true")
        running = asyncio.create_task(env.run("sleep 30"))
        await asyncio.sleep(0.3)
    result = await asyncio.wait_for(running, 10)  # closed while running: killed
    assert timed_out.timed_out and finished.exit_code == 0 and result.exit_code != 0
    assert numeric == []
    await until(lambda: not sandbox_pids(), 30, "the closed environment's processes gone", every_s=0.05)


def test_the_filter_covers_docker_s_denied_families() -> None:
    for name in (
        "keyctl",
        "add_key",
        "request_key",
        "unshare",
        "setns",
        "mount",
        "ptrace",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "kexec_load",
        "init_module",
        "finit_module",
        "io_uring_setup",
    ):
        assert name in DENIED_SYSCALLS, name


# personality(2) with each value, reset to the default after each; "ok" or the errno's name
_PERSONALITY_PROBE = r"""
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr, out = int(sys.argv[1]), {}
for value in json.loads(sys.argv[2]):
    r = libc.syscall(nr, ctypes.c_ulong(value))
    out[hex(value)] = "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
    libc.syscall(nr, ctypes.c_ulong(0))
print(json.dumps(out))
"""
_ADDR_NO_RANDOMIZE, _READ_IMPLIES_EXEC = 0x0040000, 0x0400000
# Docker's default profile: PER_LINUX, PER_LINUX32, UNAME26, PER_LINUX32 | UNAME26, the query
PERSONALITY_ALLOWED = (0, 0x0008, 0x0020000, 0x0020008, 0xFFFFFFFF)
_PERSONALITY_REFUSED = (
    _ADDR_NO_RANDOMIZE,  # ASLR off
    _READ_IMPLIES_EXEC,  # every readable mapping executable
    _ADDR_NO_RANDOMIZE | 0x0008,  # a refused bit beside an allowed one
    0x0020009,
    0x0001,
    0xFFFFFFFE,  # every bit but one: not the query
    (1 << 32) | 0x0040000,  # upper bits the kernel ignores do not hide a refused one
)


async def test_personality_takes_only_docker_s_allowed_values(store: LayerStore, tight: SandboxLimits) -> None:
    values = json.dumps([*PERSONALITY_ALLOWED, *_PERSONALITY_REFUSED])
    probe = f"python3 -c {_quote(_PERSONALITY_PROBE)} {syscall_number('personality')} {_quote(values)}"
    rc, control, err = await run_bare(store, probe)
    assert rc == 0, err
    assert json.loads(control)[hex(_ADDR_NO_RANDOMIZE)] == "ok"  # ASLR can be turned off bare ...
    with Environment.create(store, {}, tight) as env:
        result = await env.run(probe)
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert {hex(v): seen[hex(v)] for v in PERSONALITY_ALLOWED} == {hex(v): "ok" for v in PERSONALITY_ALLOWED}
    refused = {hex(v): seen[hex(v)] for v in _PERSONALITY_REFUSED}
    assert refused == {hex(v): "EPERM" for v in _PERSONALITY_REFUSED}  # ... not in the sandbox


def _freezer(name: str) -> str | None:
    root = "/sys/fs/cgroup/freezer"
    if not os.path.isfile(os.path.join(root, "cgroup.procs")):
        return None
    path = os.path.join(root, name)
    os.mkdir(path)
    return path


async def test_a_command_that_outlives_its_kill_blocks_snapshots_until_it_is_gone(
    store: LayerStore, tight: SandboxLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox whose processes do not die on SIGKILL (frozen here; in the wild, stuck in the
    kernel) must leave the environment busy, not let a snapshot copy a tree they still write."""
    freezer = _freezer(f"asyncrl-test-{os.getpid()}")
    if freezer is None:
        pytest.skip("no cgroup v1 freezer on this host")
    monkeypatch.setattr("sandbox._process._REAP_TIMEOUT_S", 0.5)
    try:
        with Environment.create(store, {}, tight.replace(wall_time_s=30.0)) as env:
            task = asyncio.create_task(env.run("while :; do echo x >> log; sleep 0.01; done", timeout_s=5.0))
            log = os.path.join(env.workspace_path, "log")
            for _ in range(600):  # the loop writes: bwrap, the init and bash exist to be frozen
                if os.path.exists(log):
                    break
                await asyncio.sleep(0.05)
            for pid in sorted(sandbox_pids()):  # bwrap, tini, bash: everything of the sandbox uid
                with contextlib.suppress(ProcessLookupError), open(os.path.join(freezer, "cgroup.procs"), "w") as f:
                    f.write(str(pid))  # (a short-lived sleep may be gone already)
            with open(os.path.join(freezer, "freezer.state"), "w") as f:
                f.write("FROZEN")
            result = await asyncio.wait_for(task, 10)  # bounded, although nothing it killed has died
            assert result.timed_out
            with pytest.raises(SandboxStateError, match="running"):
                env.snapshot()
            with pytest.raises(TimeoutError):  # bounded while they cannot die
                await env.wait_idle(0.5)
            with open(os.path.join(freezer, "freezer.state"), "w") as f:
                f.write("THAWED")
            await env.wait_idle(30.0)  # the killed inits exit once thawed
            assert sandbox_pids() == []
            env.snapshot().release()  # gone: the environment is usable again
    finally:
        with open(os.path.join(freezer, "freezer.state"), "w") as f:
            f.write("THAWED")
        for _ in range(100):
            try:
                os.rmdir(freezer)
                break
            except OSError:
                await asyncio.sleep(0.05)


# i386's getpid through ``int 0x80`` from x86-64 code, and x32's getpid: a filter that checked only
# syscall numbers would let keyctl & co. through these ABIs under other numbers.
_FOREIGN_ABI_PROBE = r"""
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
if sys.argv[1] == "x32":
    print("x32 returned", libc.syscall(0x40000000 | 39))
else:
    code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20; int 0x80; ret
    print("int80 returned", ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(code)))())
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="foreign ABIs of x86-64")
async def test_foreign_syscall_abis_kill_the_process(store: LayerStore, tight: SandboxLimits) -> None:
    probe = f"python3 -c {_quote(_FOREIGN_ABI_PROBE)}"
    cmd = f"{probe} int80; echo rc=$?; {probe} x32; echo rc=$?"
    _, control, _ = await run_bare(store, cmd)
    assert "int80 returned" in control  # the 32-bit ABI is open on this kernel ...
    with Environment.create(store, {}, tight) as env:
        result = await env.run(cmd)
    assert "returned" not in result.stdout  # ... and closed in the sandbox:
    assert result.stdout.split() == ["rc=159", "rc=159"]  # 128 + SIGSYS


async def test_memory_cgroup_oom_kills_the_sandbox_not_the_host_process(
    store: LayerStore, tight: SandboxLimits
) -> None:
    """Commands are forked by a thread of this process that sits in the environment's memory
    cgroup; the cgroup's OOM killer must still choose among the sandbox's processes only, even when
    this process is by far the biggest (as an actor holding a model is)."""
    if store.cgroup is None:
        pytest.skip("no delegable memory cgroup on this host")
    ballast = bytearray(400 * 1024 * 1024)
    ballast[::4096] = b"x" * len(ballast[::4096])  # resident, so it would be the OOM killer's pick
    hog = "a = bytearray(250 * 1024**2); a[::4096] = b'x' * len(a[::4096]); print('kept')"
    limits = tight.replace(memory_bytes=512 * 1024 * 1024, total_memory_bytes=128 * 1024 * 1024, wall_time_s=20.0)
    with Environment.create(store, {"hog.py": hog}, limits) as env:
        result = await env.run("python3 hog.py; echo rc=$?")
    assert "kept" not in result.stdout and "rc=137" in result.stdout  # the hog was killed, and we are alive
    assert len(ballast) == 400 * 1024 * 1024


async def test_a_closed_environment_s_cgroup_serves_the_next_one_under_its_limit(
    store: LayerStore, tight: SandboxLimits
) -> None:
    """Placing a task in a cgroup waits for an RCU grace period, so cgroups and their spawner
    threads are recycled; the next environment must get its own limit and a fresh peak."""
    if store.cgroups is None or store.cgroup is None or store.cgroup[1] != 1:
        pytest.skip("no delegable cgroup v1 memory hierarchy on this host")
    hog = "a = bytearray(100 * 1024**2); a[::4096] = b'x' * len(a[::4096])"
    with Environment.create(store, {"hog.py": hog}, tight) as first:
        await first.run("python3 hog.py")
        assert first._cgroup is not None
        path = first._cgroup.path
    limit = 200 * 1024 * 1024
    with Environment.create(store, {}, tight.replace(total_memory_bytes=limit)) as second:
        assert second._cgroup is not None and second._cgroup.path == path
        running = asyncio.create_task(second.run("sleep 3"))
        inside: set[int] = set()

        def started_inside() -> bool:  # spawner thread, bwrap, init, sleep
            with open(os.path.join(path, "tasks")) as f:
                inside.update(int(tid) for tid in f.read().split())
            return len(inside) >= 3 or running.done()

        await until(started_inside, 30, "the command started in the recycled cgroup", every_s=0.05)
        await running

        def read(name: str) -> int:
            with open(os.path.join(path, name)) as f:
                return int(f.read())

        assert read("memory.limit_in_bytes") == limit
        assert read("memory.max_usage_in_bytes") < 100 * 1024 * 1024  # not the first one's peak
    assert set(sandbox_pids()) == set() and len(inside) >= 3  # spawner thread, bwrap, init, sleep
