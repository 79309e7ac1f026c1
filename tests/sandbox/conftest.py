"""Fixtures for sandbox tests: a real LayerStore per test and a host-cleanliness check."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator

import pytest

from sandbox import _mount
from sandbox.config import SandboxConfig, SandboxLimits
from sandbox.layers import LayerStore
from tests.sandbox_store import open_layer_store_or_skip

# A uid of our own (not nobody) and a root of our own, so sandboxes that other processes on the
# machine run at the same time cannot be mistaken for leaks of these tests, nor these for theirs.
# Environments run as host uids of a range of our own too (one per environment), disjoint from the
# default range (0x70000000 + 65536) and from other test sessions' (one of 1000 slots).
SANDBOX_UID = 200_000 + secrets.randbelow(100_000)
ENV_UID_COUNT = 4096
ENV_UID_BASE = 1_900_000_000 + secrets.randbelow(1000) * ENV_UID_COUNT
TEST_ROOT = "/var/tmp/asyncrl-sandbox-tests"
TEST_CONFIG = SandboxConfig(
    root_dir=TEST_ROOT,
    sandbox_uid=SANDBOX_UID,
    sandbox_gid=SANDBOX_UID,
    env_uid_base=ENV_UID_BASE,
    env_uid_count=ENV_UID_COUNT,
)


def is_sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is one a sandbox of these tests runs as (the shared one or an environment's)."""
    return uid == SANDBOX_UID or ENV_UID_BASE <= uid < ENV_UID_BASE + ENV_UID_COUNT


def sandbox_pids() -> list[int]:
    """Live host pids running as a sandbox uid (zombies excluded: they run nothing and wait
    only for the host's pid 1 to reap them)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("State:") and line.split()[1] == "Z":
                        break
                    if line.startswith("Uid:"):
                        if is_sandbox_uid(int(line.split()[1])):
                            pids.append(int(name))
                        break
        except OSError:
            continue
    return pids


def _owned_by_sandbox(directory: str) -> list[str]:
    names = []
    for name in os.listdir(directory):
        try:
            if is_sandbox_uid(os.lstat(os.path.join(directory, name)).st_uid):
                names.append(name)
        except FileNotFoundError:
            continue
    return sorted(names)


def _sandbox_mounts() -> list[str]:
    """This process's sandbox mounts: its stores are ``TEST_ROOT/<pid>-<token>``, and the suite's parallel
    workers (other processes) mount and unmount theirs under the same root meanwhile."""
    own = os.path.join(TEST_ROOT, f"{os.getpid()}-")
    return sorted(m for m in _mount.mounts_under(TEST_ROOT) if m.startswith(own))


def host_fingerprint() -> dict[str, object]:
    """What a sandbox escape or leak would change (other processes share /tmp, so only what
    the sandbox uid owns there counts)."""
    with open("/etc/passwd", "rb") as f:
        passwd = hashlib.sha256(f.read()).hexdigest()
    return {
        "passwd": passwd,
        "tmp_owned_by_sandbox": _owned_by_sandbox("/tmp"),
        "var_tmp_owned_by_sandbox": _owned_by_sandbox("/var/tmp"),
        "root": sorted(os.listdir("/")),
        "sandbox_pids": sandbox_pids(),
        "sandbox_mounts": _sandbox_mounts(),
    }


@pytest.fixture
def store() -> Iterator[LayerStore]:
    s = open_layer_store_or_skip(TEST_CONFIG)
    try:
        yield s
    finally:
        s.close()
        assert _mount.mounts_under(s.dir) == [], "store left mounts behind"
        assert not os.path.exists(s.dir), "store left files behind"
        if s.cgroup is not None:
            left = [n for n in os.listdir(s.cgroup[0]) if n.startswith(f"asyncrl-{s.name}")]
            assert left == [], f"store left cgroups behind: {left}"


@pytest.fixture
def host_unchanged(store: LayerStore) -> Iterator[None]:
    """Asserts the host looks the same after the test (files, mounts, processes)."""
    before = host_fingerprint()
    yield
    after = host_fingerprint()
    assert after == before


@pytest.fixture
def tight() -> SandboxLimits:
    return SandboxLimits(
        cpu_time_s=5,
        memory_bytes=256 * 1024 * 1024,
        file_size_bytes=16 * 1024 * 1024,
        num_processes=32,
        wall_time_s=5.0,
        output_bytes=4096,
        disk_bytes=32 * 1024 * 1024,
        num_inodes=2000,
    )
