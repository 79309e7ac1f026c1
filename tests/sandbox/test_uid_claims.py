"""Environment uids are claimed host-wide (`sandbox._ids`): the kernel's per-uid quotas are the host's,
so stores of different roots (actor kinds, runs) never hand out the same uid; a killed store's claims
come back, after their rest; and the one claim file per host refuses a path someone else planted."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog.testing

from sandbox import Environment, LayerStore, SandboxConfig, SandboxUnavailable
from sandbox._ids import IdPool

from .conftest import ENV_UID_BASE, ENV_UID_COUNT, TEST_CONFIG, TEST_ROOT

REPO = Path(__file__).resolve().parents[2]

# A store of another process (another actor kind): claims one uid, says which, holds it until killed
_HOLDER = """
import json, sys
from sandbox._ids import IdPool
from sandbox.config import SandboxConfig
pool = IdPool(SandboxConfig(**json.loads(sys.argv[1])))
print(pool.acquire().uid, flush=True)
sys.stdin.read()
"""


def _start_holder(config: SandboxConfig) -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(dataclasses.asdict(config))], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None
    line = holder.stdout.readline()
    assert line.strip().isdigit(), f"the holder failed ({holder.wait()})"
    return holder, int(line)


def _kill(holder: subprocess.Popen[str]) -> None:
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()


@pytest.fixture
def other_roots() -> Iterator[Callable[[str], str]]:
    """Roots of other actor kinds (made empty, removed after the test with what a store of the previous
    layout, which kept its uid claims in its root, left there)."""
    made: list[str] = []

    def make(name: str) -> str:
        root = f"{TEST_ROOT}-{name}-{os.getpid()}"
        os.makedirs(root, exist_ok=True)
        made.append(root)
        return root

    yield make
    for root in made:
        for leftover in os.listdir(root):
            os.remove(os.path.join(root, leftover))
        os.rmdir(root)


def test_stores_of_different_roots_never_share_a_uid(store: LayerStore, other_roots: Callable[[str], str]) -> None:
    """Two actor kinds' stores (one root each) run environments at once: no uid is both's."""
    if store.ids is None:
        pytest.skip("no idmapped mounts here: every environment shares sandbox_uid")
    root = other_roots("kind-b")
    other = LayerStore(dataclasses.replace(TEST_CONFIG, root_dir=root))
    try:
        mine = [Environment.create(store, {}) for _ in range(3)]
        theirs = [Environment.create(other, {}) for _ in range(3)]
        try:
            uids_mine, uids_theirs = {e.uid for e in mine}, {e.uid for e in theirs}
            assert len(uids_mine) == len(uids_theirs) == 3
            assert not uids_mine & uids_theirs, (uids_mine, uids_theirs)
        finally:
            for e in mine + theirs:
                e.close()
    finally:
        other.close()
    assert os.listdir(root) == []  # the claims are the host's, not the root's


def test_a_killed_store_s_claim_comes_back(other_roots: Callable[[str], str]) -> None:
    """Another kind's process holds the range's only uid, so it is not handed out here; kill -9 it and it
    is (the kernel dropped its lock; no pid was checked)."""
    one_uid = dataclasses.replace(TEST_CONFIG, env_uid_base=ENV_UID_BASE + ENV_UID_COUNT - 1, env_uid_count=1,
                                  env_uid_quarantine_s=0.0)  # fmt: skip
    holder, held = _start_holder(dataclasses.replace(one_uid, root_dir=other_roots("kind-b")))
    try:
        pool = IdPool(dataclasses.replace(one_uid, root_dir=other_roots("kind-a")))
        try:
            with pytest.raises(SandboxUnavailable, match="by other stores on this host"):
                pool.acquire()
            _kill(holder)
            assert pool.acquire().uid == held
        finally:
            pool.close()
    finally:
        if holder.poll() is None:
            _kill(holder)


def _private_claims(tmp_path: Path, **changes: float) -> SandboxConfig:
    """A range and claim file of this test's own, so that no earlier store's marks change what it sees."""
    return dataclasses.replace(TEST_CONFIG, env_uid_claims=str(tmp_path / "claims" / "env-uids.lock"), **changes)


def test_a_dead_or_closed_store_s_unrested_uids_rest_before_reuse(tmp_path: Path) -> None:
    config = _private_claims(tmp_path, env_uid_count=3, env_uid_quarantine_s=60.0)
    holder, killed = _start_holder(config)
    _kill(holder)
    closed = IdPool(config)
    try:
        # the killed store's uid is free but rests (nobody knows since when): the next ones are handed out
        assert (killed, closed.acquire().uid, closed.acquire().uid) == (ENV_UID_BASE, ENV_UID_BASE + 1,
                                                                        ENV_UID_BASE + 2)  # fmt: skip
    finally:
        closed.close()  # neither released: both still need their rest
    quick = IdPool(dataclasses.replace(config, env_uid_quarantine_s=0.0))
    try:
        again = quick.acquire()
        assert again.uid == ENV_UID_BASE  # rested its 0 s here
        quick.release(again, lambda: True)
    finally:
        quick.close()  # it rested fully: marked clean for the next store
    nxt = IdPool(config)
    try:
        assert nxt.acquire().uid == ENV_UID_BASE  # clean: at once, although rests last 60 s here
        with structlog.testing.capture_logs() as logs:  # the closed store's two rest: only reused early, and said so
            assert nxt.acquire().uid == ENV_UID_BASE + 1
        assert [e["event"] for e in logs] == ["sandbox_uid_reused_early"] and logs[0]["uid"] == ENV_UID_BASE + 1
    finally:
        nxt.close()


def _refused(config: SandboxConfig, needle: str) -> None:
    with pytest.raises(SandboxUnavailable, match=needle) as info:
        IdPool(config)
    assert config.env_uid_claims in str(info.value) and "env_uid_claims" in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="plants files of another user")
def test_a_planted_or_foreign_claim_file_is_refused(tmp_path: Path) -> None:
    config = _private_claims(tmp_path)
    claims = Path(config.env_uid_claims)
    IdPool(config).close()  # made fresh: closed to everyone else
    assert stat.S_IMODE(claims.parent.stat().st_mode) == 0o700 and stat.S_IMODE(claims.stat().st_mode) == 0o600

    target = tmp_path / "target"
    target.write_bytes(b"")
    claims.unlink()
    claims.symlink_to(target)
    _refused(config, "is a symbolic link")
    assert target.read_bytes() == b""  # not opened through the link

    claims.unlink()
    claims.touch(0o600)
    os.chown(claims, 12345, 12345)
    _refused(config, "belongs to uid 12345, not this process's 0")
    os.chown(claims, 0, 0)
    claims.chmod(0o644)
    _refused(config, "has mode 644")

    moved = tmp_path / "moved"
    claims.parent.rename(moved)
    claims.parent.symlink_to(moved)  # the directory itself a link
    _refused(config, "is a symbolic link or not a directory")
    claims.parent.unlink()
    claims.parent.mkdir(0o700)
    os.chown(claims.parent, 12345, 12345)
    _refused(config, "the directory belongs to uid 12345")


def test_a_store_refused_its_claims_leaves_nothing(store: LayerStore, tmp_path: Path) -> None:
    if store.ids is None:
        pytest.skip("no idmapped mounts here: the store claims no uids")
    planted = tmp_path / "claims"
    planted.symlink_to(tmp_path)
    ours = f"{os.getpid()}-"  # a store's directory is <pid>-<random>: other workers' stores come and go beside
    before = sorted(d for d in os.listdir(TEST_ROOT) if d.startswith(ours))
    with pytest.raises(SandboxUnavailable, match="symbolic link"):
        LayerStore(dataclasses.replace(TEST_CONFIG, env_uid_claims=str(planted / "env-uids.lock")))
    assert sorted(d for d in os.listdir(TEST_ROOT) if d.startswith(ours)) == before
