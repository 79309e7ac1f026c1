"""Budgets that hold on the host: what a sandbox can make the host write, create, walk or hold
in memory through snapshot, score, close, export and import (sparse files, hard links, deep
trees, inode-dense and memory-heavy archives), and every host walk iterative."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
import tracemalloc

import pytest
import zstandard

from sandbox import (
    Environment,
    LayerStore,
    SandboxLimits,
    SandboxViolation,
    SnapshotFormatError,
    Task,
    export_snapshot_bytes,
    import_snapshot_bytes,
    score,
)
from sandbox._safepath import write_atomic
from sandbox._tree import TreeBudget, copy_tree, open_regular_at, remove_tree, walk

pytestmark = pytest.mark.usefixtures("host_unchanged")

_MIB = 1024 * 1024


def _allocated(path: str) -> int:
    """Bytes allocated under ``path``, each inode once (as the disk pays for them)."""
    seen, total = set(), 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _du(path: str) -> int:
    """Bytes the disk allocated under ``path``, as ``du`` counts them (the operator's measure)."""
    out = subprocess.run(["du", "-s", "-B1", path], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.fixture
def quota16() -> SandboxLimits:
    return SandboxLimits(
        disk_bytes=16 * _MIB, file_size_bytes=1024 * _MIB, wall_time_s=20.0, num_inodes=4000, max_dir_depth=64
    )


async def test_snapshot_keeps_sparse_files_sparse(store: LayerStore, quota16: SandboxLimits) -> None:
    with Environment.create(store, {}, quota16) as env:
        made = await env.run(
            "truncate -s 240M sparse && printf marker | dd of=sparse bs=1 seek=100000000 conv=notrunc 2>/dev/null"
            " && du -k sparse | cut -f1"
        )
        assert made.exit_code == 0, made.stderr
        assert int(made.stdout) < 1024  # tiny inside ...
        snap = env.snapshot()
    with snap:
        assert _allocated(snap.layers[0].path) < 1 * _MIB  # ... and on the host (was 240 MiB)
        with Environment.fork(snap, quota16) as fork:
            seen = await fork.run("stat -c %s sparse; dd if=sparse bs=1 skip=100000000 count=6 2>/dev/null")
    assert seen.stdout.split() == [str(240 * _MIB), "marker"]


async def test_snapshot_keeps_hard_links_as_links(store: LayerStore, quota16: SandboxLimits) -> None:
    with Environment.create(store, {}, quota16) as env:
        made = await env.run("head -c 8M /dev/urandom > big && for i in $(seq 30); do ln big l$i; done; echo ok")
        assert "ok" in made.stdout, made.stderr
        snap = env.snapshot()
    with snap:
        assert _allocated(snap.layers[0].path) < 9 * _MIB  # one copy (was 31: 248 MiB)
        with Environment.fork(snap, quota16) as fork:
            seen = await fork.run("stat -c %h l7; cmp big l30 && echo same")
    assert seen.stdout.split() == ["31", "same"]  # still one file with 31 names


async def test_deep_tree_fails_the_snapshot_cleanly(store: LayerStore, quota16: SandboxLimits) -> None:
    deep = "/".join(["d"] * 1100)
    with Environment.create(store, {"keep.txt": "k\n"}, quota16) as env:
        made = await env.run(f"mkdir -p {deep} && echo x > {deep}/leaf && echo made")
        assert "made" in made.stdout, made.stderr
        layers_before = sorted(os.listdir(store.layers_dir))
        with pytest.raises(SandboxViolation, match="deeper than the 64 levels"):
            env.snapshot()
        assert sorted(os.listdir(store.layers_dir)) == layers_before  # no orphan layer
        again = await env.run("cat keep.txt; ls d >/dev/null && echo still-there")  # the environment goes on
        assert again.stdout.split() == ["k", "still-there"]
        task = Task(id="t", prompt="p", files={}, hidden_tests={"test_a.py": "def test_a():\n    pass\n"})
        outcome = await score(env, task)  # graded as failing, not a RecursionError in the reward path
        assert (outcome.num_passed, outcome.num_total) == (0, 1)
        assert "deeper than the 64 levels" in outcome.details[0].detail
        await env.run(f"rm -rf d; mkdir -p {'/'.join(['e'] * 60)}")
        env.snapshot().release()  # within the budget again
    assert sorted(os.listdir(store.layers_dir)) == []


async def test_deep_tree_in_the_writable_layer_is_removed_on_close(store: LayerStore, tight: SandboxLimits) -> None:
    with Environment.create(store, {}, tight.replace(num_inodes=5000)) as env:
        made = await env.run("python3 -c \"import os\nfor _ in range(1500): os.mkdir('d'); os.chdir('d')\"; echo ok")
        assert "ok" in made.stdout, made.stderr
    assert not os.path.exists(env.dir)


def _deep_host_tree(root: str, depth: int) -> str:
    os.mkdir(root, 0o700)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            os.mkdir("d", dir_fd=fd)
            if i % 100 == 0:
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
                    f.write("x")
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return root


def test_host_walks_are_iterative(store: LayerStore) -> None:
    deep = _deep_host_tree(os.path.join(store.dir, "deep"), 3000)  # path longer than PATH_MAX too
    with pytest.raises(SandboxViolation, match="deeper"):
        copy_tree(deep, store.new_layer_dir()[1], keep_whiteouts=True, budget=TreeBudget(1 << 30, 1 << 20, 128))
    # hidden tests installed over a deep tree an agent left where a test file goes
    write_atomic(deep, ("d", "test_x.py"), b"def test_x(): pass\n", uid=0, gid=0, force=True)
    with open(os.path.join(deep, "d", "test_x.py"), "rb") as f:
        assert f.read() == b"def test_x(): pass\n"
    _deep_host_tree(os.path.join(store.dir, "deep2"), 3000)  # left for the store's close to remove
    remove_tree(deep)
    assert not os.path.exists(deep)


def test_copy_budget_counts_data_not_holes_and_stops_past_it(store: LayerStore) -> None:
    src = os.path.join(store.dir, "src")
    os.mkdir(src)
    with open(os.path.join(src, "data"), "wb") as f:
        f.write(os.urandom(3 * _MIB))
    with open(os.path.join(src, "sparse"), "wb") as f:
        f.truncate(1 << 40)  # a terabyte of holes
    dst = store.new_layer_dir()[1]
    usage = copy_tree(src, dst, keep_whiteouts=True, budget=TreeBudget(4 * _MIB, 10, 4))
    assert usage.num_bytes == _du(dst) and usage.num_inodes == 2
    assert 3 * _MIB <= usage.num_bytes < 3 * _MIB + 64 * 1024  # the data and the directory's block
    assert os.stat(os.path.join(dst, "sparse")).st_size == 1 << 40
    with pytest.raises(SandboxViolation, match="bytes allowed"):
        copy_tree(src, store.new_layer_dir()[1], keep_whiteouts=True, budget=TreeBudget(2 * _MIB, 10, 4))
    with pytest.raises(SandboxViolation, match="files and directories allowed"):
        copy_tree(src, store.new_layer_dir()[1], keep_whiteouts=True, budget=TreeBudget(4 * _MIB, 1, 4))


def _zstd_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.mode = 0o644
    return info


def test_import_budgets_inodes_not_only_bytes(store: LayerStore) -> None:
    many = _zstd_tar([(_info(f"f{i}"), b"") for i in range(10_010)])
    assert len(many) < 64 * 1024
    with pytest.raises(SnapshotFormatError, match="max_inodes=1000"):
        import_snapshot_bytes(store, many, max_bytes=4096, max_inodes=1000)
    implied = _zstd_tar([(_info("/".join(f"d{i}" for i in range(100)) + "/f"), b"")])  # 100 directories, 1 member
    with pytest.raises(SnapshotFormatError, match="max_inodes=50"):
        import_snapshot_bytes(store, implied, max_inodes=50, max_depth=200)
    with pytest.raises(SnapshotFormatError, match="max_depth=64"):
        import_snapshot_bytes(store, implied, max_depth=64)
    assert os.listdir(store.layers_dir) == []


def test_import_streams_members_instead_of_holding_them(store: LayerStore) -> None:
    size = 64 * _MIB
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        tar.addfile(_info("zeros", size=size), io.BytesIO(bytes(size)))
    data = zstandard.ZstdCompressor().compress(raw.getvalue())
    del raw
    assert len(data) < 64 * 1024
    tracemalloc.start()
    try:
        with import_snapshot_bytes(store, data) as snap:
            _, peak = tracemalloc.get_traced_memory()
            assert os.stat(os.path.join(snap.layers[0].path, "zeros")).st_size == size
    finally:
        tracemalloc.stop()
    assert peak < 16 * _MIB, peak  # was the whole member: 64 MiB


@pytest.mark.parametrize(
    "members",
    [
        [(_info("a"), b""), (_info("a/b"), b"")],  # a file where a directory must go
        [(_info("a", tarfile.DIRTYPE), None), (_info("a"), b"")],  # a file over a directory
        [(_info("x"), b""), (_info("x", tarfile.DIRTYPE), None)],  # a directory over a file
        [(_info("s", tarfile.SYMTYPE), None), (_info("s/f"), b"")],  # through a symlink
    ],
)
def test_import_conflicts_are_format_errors(store: LayerStore, members: list) -> None:
    for info, _ in members:
        if info.issym():
            info.linkname = "elsewhere"
    with pytest.raises(SnapshotFormatError):
        import_snapshot_bytes(store, _zstd_tar(members))
    assert os.listdir(store.layers_dir) == []


async def test_export_refuses_more_than_an_import_accepts(store: LayerStore, quota16: SandboxLimits) -> None:
    with Environment.create(store, {}, quota16) as env:
        await env.run("for i in 1 2 3; do truncate -s 40M s$i; done")
        with env.snapshot() as snap:
            with pytest.raises(SandboxViolation, match="max_bytes"):
                export_snapshot_bytes(snap, max_bytes=100 * _MIB)  # zeros for the reward actor to unpack
            assert len(export_snapshot_bytes(snap, max_bytes=128 * _MIB)) < 1 * _MIB
            with pytest.raises(SandboxViolation, match="max_inodes=2"):
                export_snapshot_bytes(snap, max_bytes=128 * _MIB, max_inodes=2)


def test_walks_never_follow_entries_swapped_under_them(store: LayerStore) -> None:
    """What a process still running in a workspace could do mid-copy: swap a listed file or a
    directory not yet entered for a symlink to the host. The walk never follows it."""
    src = os.path.join(store.dir, "swap")
    os.makedirs(os.path.join(src, "d"))
    for name in ("a", "f"):
        with open(os.path.join(src, name), "w") as f:
            f.write("x")
    steps = walk(src, 8)
    first = next(steps)  # the root is listed and "a" examined; "d" and "f" are still to come
    assert first.name == "a"
    os.rename(os.path.join(src, "d"), os.path.join(src, "d.old"))
    os.symlink("/etc", os.path.join(src, "d"))
    seen = {}
    for entry in steps:
        if entry.leaving:
            continue
        seen["/".join(entry.rel)] = entry
        if entry.name == "f":  # listed as a file, then swapped before it is opened
            os.rename(os.path.join(src, "f"), os.path.join(src, "f.old"))
            os.symlink("/etc/passwd", os.path.join(src, "f"))
            with pytest.raises(SandboxViolation, match="changed while the host walked it"):
                os.close(open_regular_at(entry))
    assert stat.S_ISLNK(seen["d"].st.st_mode)  # reported as the symlink it now is ...
    assert not [rel for rel in seen if rel.startswith("d/")]  # ... and never entered


# metadata costs whole blocks on the host's disk: 30,000 of each is ~117 MiB there, 0 bytes of data
_METADATA_ATTACKS = {
    "directories": "import os\nfor i in range(30000): os.mkdir(f'd{i}')",
    "long symlinks": "import os\nfor i in range(30000): os.symlink('t' * 100 + str(i), f's{i}')",
    "one-byte files": "import os\nfor i in range(30000): open(f'f{i}', 'w').write('x')",
}


@pytest.mark.parametrize("attack", sorted(_METADATA_ATTACKS))
async def test_snapshot_charges_metadata_its_blocks_on_the_host(store: LayerStore, attack: str) -> None:
    limits = SandboxLimits(disk_bytes=16 * _MIB, num_inodes=40_000, wall_time_s=60.0)
    with Environment.create(store, {}, limits) as env:
        made = await env.run(f"python3 -c {_quote(_METADATA_ATTACKS[attack])} && ls | wc -l", timeout_s=60)
        assert made.stdout.split() == ["30000"], made.stderr  # the tmpfs holds them (its metadata is memory)
        with pytest.raises(SandboxViolation, match="bytes allowed on the host disk"):
            env.snapshot()
    assert os.listdir(store.layers_dir) == []


async def test_snapshot_charges_what_du_measures(store: LayerStore) -> None:
    limits = SandboxLimits(disk_bytes=16 * _MIB, num_inodes=40_000, wall_time_s=60.0)
    mixed = (
        "import os\nfor i in range(600): os.mkdir(f'd{i}'); os.symlink('t' * 100, f's{i}')\n"
        "os.mkdir('big')\nfor i in range(3000): open(f'big/{\"n\" * 100}{i}', 'w').close()"  # a grown directory
    )
    with Environment.create(store, {"a.py": "x = 1\n" * 1000}, limits) as env:
        made = await env.run(f"python3 -c {_quote(mixed)}", timeout_s=60)
        assert made.exit_code == 0, made.stderr
        with env.snapshot() as snap:
            top = snap.layers[0]
            assert top.usage.num_bytes == _du(top.path) <= limits.disk_bytes
            assert top.usage.num_bytes > 1200 * 4096  # every directory and long symlink is charged


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


@pytest.mark.parametrize("kind", ["directories", "long symlinks"])
def test_import_charges_metadata_its_blocks_on_the_host(store: LayerStore, kind: str) -> None:
    if kind == "directories":
        members = [(_info(f"d{i}", tarfile.DIRTYPE), None) for i in range(30_000)]
    else:
        members = [(_info(f"s{i}", tarfile.SYMTYPE), None) for i in range(30_000)]
        for info, _ in members:
            info.linkname = "t" * 200
    archive = _zstd_tar(members)
    assert len(archive) < 1 * _MIB  # a small archive ...
    with pytest.raises(SnapshotFormatError, match="max_bytes=16777216 bytes of disk"):
        import_snapshot_bytes(store, archive, max_bytes=16 * _MIB, max_inodes=100_000)  # ... ~117 MiB unpacked
    with pytest.raises(SnapshotFormatError, match="max_bytes=4096 bytes of disk"):
        import_snapshot_bytes(store, archive, max_bytes=4096, max_inodes=100_000)
    assert os.listdir(store.layers_dir) == []
    few = _zstd_tar(members[:1000])
    with import_snapshot_bytes(store, few, max_bytes=16 * _MIB) as snap:
        layer = snap.layers[0]
        assert layer.usage.num_bytes == _du(layer.path) <= 16 * _MIB
