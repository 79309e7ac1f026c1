"""Clear errors when the host lacks what the sandbox needs; config validation; path rules."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import LayerStore, SandboxConfig, SandboxLimits, SandboxUnavailable, SandboxViolation
from sandbox._safepath import split_relpath


def test_missing_bwrap_says_how_to_install() -> None:
    with pytest.raises(SandboxUnavailable, match=r"install_system_deps\.sh") as info:
        LayerStore(SandboxConfig(bwrap_path="/nonexistent/bwrap"))
    assert isinstance(info.value, RuntimeError)


def test_non_root_is_told_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        LayerStore()


def test_missing_overlayfs_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import sandbox._host as host

    monkeypatch.setattr(host, "_filesystems", lambda: {"ext4", "tmpfs"})
    monkeypatch.setattr(host.subprocess, "run", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match="overlayfs"):
        host._check_overlay()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"memory_bytes": 1024}, "memory_bytes"),
        ({"wall_time_s": 0}, "wall_time_s"),
        ({"num_processes": 2}, "num_processes"),
    ],
)
def test_limits_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SandboxLimits(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"root_dir": "relative"}, "absolute"),
        ({"root_dir": "/var/tmp/a:b"}, "overlayfs"),
        ({"sandbox_uid": 0}, "unprivileged"),
        ({"workspace_dir": "/usr"}, "workspace_dir"),
        ({"max_layer_depth": 1}, "max_layer_depth"),
        ({"env_uid_base": 1000}, "env_uid_base"),  # real users' ids
        ({"env_uid_base": (1 << 31) - 10}, "env_uid_base"),  # read as negative by some tools
        ({"env_uid_count": -1}, "env_uid_count"),
    ],
)
def test_config_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SandboxConfig(**kwargs)


@given(st.lists(st.sampled_from(["a", "b", "..", ".", "", "/", "c.txt"]), max_size=8).map("/".join))
def test_split_relpath_never_yields_dotdot(path: str) -> None:
    try:
        parts = split_relpath(path)
    except SandboxViolation:
        assert ".." in path.split("/") or (path.startswith("/") and not path.startswith("/workspace"))
        return
    assert ".." not in parts and "" not in parts and "." not in parts
    assert all("/" not in p for p in parts)


def test_a_crashed_process_leaves_nothing_behind_after_the_next_store(store: LayerStore) -> None:
    """A process killed with environments open leaks mounts; the next LayerStore reaps them."""
    import subprocess
    import sys

    from sandbox import _mount

    from .conftest import TEST_CONFIG

    crash_root = f"{TEST_CONFIG.root_dir}-crash-{os.getpid()}"
    script = (
        "import dataclasses, os, sys\n"
        "from sandbox import Environment, LayerStore\n"
        "from tests.sandbox.conftest import TEST_CONFIG\n"
        f"s = LayerStore(dataclasses.replace(TEST_CONFIG, root_dir={crash_root!r}))\n"
        "envs = [Environment.create(s, {'a': 'x'}) for _ in range(3)]\n"
        "print(s.dir, flush=True)\n"
        "os._exit(0)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, check=True)
    leaked_dir = out.stdout.split()[-1]
    # tmpfs + overlay + its idmapped view of the layer, per environment
    assert len(_mount.mounts_under(os.path.join(leaked_dir, "E"))) == 9
    assert len(_mount.mounts_under(os.path.join(leaked_dir, "V"))) <= 1  # the shared layer's idmapped view
    LayerStore(TEST_CONFIG).close()
    assert _mount.mounts_under(leaked_dir) == []
    assert not os.path.exists(leaked_dir)
    if store.cgroup is not None:
        name = f"asyncrl-{os.path.basename(leaked_dir)}"
        assert [n for n in os.listdir(store.cgroup[0]) if n.startswith(name)] == []
    os.rmdir(crash_root)  # empty: the uid claims are the host's file, not the root's


def test_forbidden_mounts_are_reported(store: LayerStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import sandbox.layers as layers

    from .conftest import TEST_CONFIG

    def deny(*args: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(layers._mount, "mount", deny)
    with pytest.raises(SandboxUnavailable, match="CAP_SYS_ADMIN"):
        LayerStore(TEST_CONFIG)
