"""Snapshot and fork semantics, O(1) forks with no tree copy, squash, export/import."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import statistics
import tarfile
import time

import pytest
import zstandard

from sandbox import (
    Environment,
    LayerStore,
    SandboxStateError,
    SandboxUnavailable,
    SnapshotFormatError,
    _mount,
    export_snapshot_bytes,
    import_snapshot_bytes,
)

from .conftest import TEST_CONFIG


def _disk_bytes(path: str) -> int:
    """Allocated bytes of files under ``path`` on its filesystem, not crossing mounts (nor an
    environment's idmapped views of layers: binds of the same filesystem, copying nothing)."""
    mounts = set(_mount.mounts_under(path))
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in mounts]
        for name in filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _tmpfs_used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


async def test_fork_sees_snapshot_and_writes_are_isolated(store: LayerStore) -> None:
    with Environment.create(store, {"a.txt": "base\n", "d/keep.txt": "k\n", "d/gone.txt": "g\n"}) as parent:
        await parent.run("echo parent > p.txt; rm d/gone.txt; echo changed > a.txt")
        snap = parent.snapshot()
        with snap, Environment.fork(snap) as f1, Environment.fork(snap) as f2:
            seen = await f1.run("cat a.txt p.txt d/keep.txt; ls d")
            assert seen.stdout.split() == ["changed", "parent", "k", "keep.txt"]
            await f1.run("echo one > f1.txt; echo f1 > a.txt; rm p.txt")
            await f2.run("echo two > f2.txt")
            assert (await f2.run("ls; cat a.txt")).stdout.split() == ["a.txt", "d", "f2.txt", "p.txt", "changed"]
            assert (await parent.run("ls; cat a.txt")).stdout.split() == ["a.txt", "d", "p.txt", "changed"]
            await parent.run("echo later > later.txt")
            assert "later.txt" not in (await f1.run("ls")).stdout
            assert (await f1.run("ls; cat a.txt")).stdout.split() == ["a.txt", "d", "f1.txt", "f1"]


async def test_hundred_forks_are_constant_time_and_copy_nothing(store: LayerStore) -> None:
    tree = {f"pkg/m{i}.py": "x = 1\n" * 2000 for i in range(50)}  # ~600 KB
    with Environment.create(store, tree) as env:
        snap = env.snapshot()
    with snap:
        layer_bytes = _disk_bytes(snap.layers[0].path)
        disk_before = _disk_bytes(store.dir)
        forks, times = [], []
        try:
            for _ in range(100):
                t0 = time.perf_counter()
                forks.append(Environment.fork(snap))
                times.append(time.perf_counter() - t0)
            added_disk = _disk_bytes(store.dir) - disk_before
            added_tmpfs = sum(_tmpfs_used(os.path.join(f.dir, "rw")) for f in forks)
            result = await forks[-1].run("cat pkg/m49.py | wc -l")
            assert result.stdout.strip() == "2000"
        finally:
            for f in forks:
                f.close()
    assert layer_bytes > 500_000
    # 100 forks add less than one copy of the tree, in total, on disk and in their tmpfs
    assert added_disk + added_tmpfs < layer_bytes, (added_disk, added_tmpfs, layer_bytes)
    first, last = statistics.median(times[:20]), statistics.median(times[-20:])
    assert last < 3 * first + 0.02, (first, last)  # no growth with the number of forks (slack: shared CPU)
    assert statistics.median(times) < 0.05


async def test_snapshot_cost_follows_the_change_and_keeps_history(store: LayerStore) -> None:
    tree = {f"f{i}.txt": "y" * 10_000 for i in range(100)}
    with Environment.create(store, tree) as env:
        await env.run("echo 1 > one.txt")
        s1 = env.snapshot()
        layer_bytes = _disk_bytes(s1.layers[0].path)
        assert layer_bytes < 64 * 1024  # only the change, not the 1 MB tree
        s_same = env.snapshot()  # nothing changed: no new layer
        assert s_same.layers == s1.layers
        await env.run("echo 2 > one.txt; rm f0.txt")
        s2 = env.snapshot()
        with s1, s_same, s2, Environment.fork(s1) as f1, Environment.fork(s2) as f2:
            assert (await f1.run("cat one.txt; ls f0.txt")).stdout.split() == ["1", "f0.txt"]
            r2 = await f2.run("cat one.txt; ls f0.txt")
            assert r2.stdout.split() == ["2"] and r2.exit_code != 0


async def test_layer_depth_is_bounded_by_squash() -> None:
    try:
        store = LayerStore(dataclasses.replace(TEST_CONFIG, max_layer_depth=3, memory_cgroup=False))
    except SandboxUnavailable as e:
        pytest.skip(f"sandbox unavailable: {e}")
    with store, Environment.create(store, {"base.txt": "b\n", "old.txt": "o\n"}) as env:
        for i in range(6):
            await env.run(f"echo {i} > n{i}.txt; rm -f old.txt")
            env.snapshot().release()
            assert env.depth <= 3
        result = await env.run("ls")
        assert result.stdout.split() == ["base.txt"] + [f"n{i}.txt" for i in range(6)]
        assert store.num_layers() <= 3
        assert store.cgroup is None and env._cgroup is None  # the rlimit-only path works too


async def test_snapshot_refuses_while_a_command_runs(store: LayerStore) -> None:
    with Environment.create(store, {}) as env:
        task = asyncio.create_task(env.run("sleep 0.5"))
        await asyncio.sleep(0.1)
        with pytest.raises(SandboxStateError, match="running"):
            env.snapshot()
        await task


async def test_layers_are_freed_when_released(store: LayerStore) -> None:
    env = Environment.create(store, {"a": "1"})
    await env.run("echo x > b")
    snap = env.snapshot()
    env.close()
    assert store.num_layers() == 2
    snap.release()
    snap.release()  # idempotent
    assert store.num_layers() == 0
    assert os.listdir(store.layers_dir) == []
    with pytest.raises(SandboxStateError):
        Environment.fork(snap)
    with pytest.raises(SandboxStateError):
        await env.run("true")


async def test_export_import_roundtrip(store: LayerStore) -> None:
    with Environment.create(store, {"a.txt": "A", "d/b.txt": "B", "gone.txt": "G"}) as env:
        await env.run("ln -s a.txt link; chmod +x d/b.txt; rm gone.txt; mkdir empty; echo C > c.txt")
        with env.snapshot() as snap:
            data = export_snapshot_bytes(snap)
    assert data[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
    with import_snapshot_bytes(store, data) as imported, Environment.fork(imported) as env2:
        result = await env2.run("ls -p; cat a.txt d/b.txt c.txt; readlink link; test -x d/b.txt && echo exec")
        assert result.stdout.split() == ["a.txt", "c.txt", "d/", "empty/", "link", "ABC", "a.txt", "exec"]


def _zstd_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode = 0o4755
    return info, data if kind == tarfile.REGTYPE else None


@pytest.mark.parametrize(
    "members",
    [
        [_member("../escape")],
        [_member("/etc/evil")],
        [_member("link", tarfile.SYMTYPE, link="/etc"), _member("link/evil")],
        [_member("hard", tarfile.LNKTYPE, link="/etc/passwd")],
        [_member("dev", tarfile.CHRTYPE)],
        [_member("fifo", tarfile.FIFOTYPE)],
    ],
)
def test_import_rejects_hostile_archives(store: LayerStore, members: list) -> None:
    with open("/etc/passwd", "rb") as f:
        passwd = f.read()
    with pytest.raises(SnapshotFormatError):
        import_snapshot_bytes(store, _zstd_tar(members))
    assert os.listdir(store.layers_dir) == []
    with open("/etc/passwd", "rb") as f:
        assert f.read() == passwd
    assert not os.path.exists("/etc/evil")


def test_import_rejects_garbage_and_oversize(store: LayerStore) -> None:
    with pytest.raises(SnapshotFormatError):
        import_snapshot_bytes(store, b"not a zstd tar")
    with pytest.raises(SnapshotFormatError, match="max_bytes"):
        import_snapshot_bytes(store, _zstd_tar([_member("big", data=b"z" * 5000)]), max_bytes=1000)


async def test_import_strips_setuid(store: LayerStore) -> None:
    with import_snapshot_bytes(store, _zstd_tar([_member("tool", data=b"#!/bin/sh\n")])) as snap:
        mode = os.stat(os.path.join(snap.layers[0].path, "tool")).st_mode
        assert mode & 0o7000 == 0


async def test_snapshot_from_files_shares_one_base_layer(store: LayerStore) -> None:
    files = {"solution.py": "def f(x):\n    pass\n"}
    with store.snapshot_from_files(files) as a, store.snapshot_from_files(files) as b:
        assert a.layers == b.layers and store.num_layers() == 1
        with Environment.fork(a) as env:
            assert (await env.run("cat solution.py")).stdout == files["solution.py"]
    assert store.num_layers() == 0
