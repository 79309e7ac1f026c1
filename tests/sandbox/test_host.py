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
