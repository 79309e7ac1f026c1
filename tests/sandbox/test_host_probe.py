"""The host probe: what it binds (never "/", which races with neighbouring sandboxes) and how it fails."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox._host import check_host
from sandbox.config import SandboxConfig
from sandbox.errors import SandboxUnavailable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the probe runs bwrap as the sandbox uid: needs root")


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A directory the sandbox uid can reach (pytest's own tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="probe-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fake_bwrap(tmp_path: Path, failures: int, message: str) -> str:
    """A bwrap stand-in failing its first `failures` calls with `message`, then succeeding; it counts its
    calls in `calls` and writes its arguments, one per line, to `argv`."""
    counter, argv = tmp_path / "calls", tmp_path / "argv"
    counter.write_text("0")
    argv.write_text("")
    counter.chmod(0o666)
    argv.chmod(0o666)
    script = tmp_path / "bwrap"
    script.write_text(f"""#!/bin/sh
n=$(cat {counter}); echo $((n + 1)) > {counter}
printf '%s\\n' "$@" > {argv}
if [ "$n" -lt {failures} ]; then echo "bwrap: {message}" >&2; exit 1; fi
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)


def test_the_probe_binds_the_system_directories_not_the_root(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, failures=0, message="")
    assert check_host(SandboxConfig(bwrap_path=bwrap)) == bwrap
    args = (tmp_path / "argv").read_text().splitlines()
    binds = [tuple(args[i + 1 : i + 3]) for i, a in enumerate(args) if a == "--ro-bind"]
    assert ("/usr", "/usr") in binds
    assert all(src != "/" for src, _ in binds), binds
    assert args[-2:] == ["--", "/bin/true"]


def test_the_real_probe_passes_while_neighbouring_sandboxes_mount_and_unmount(tmp_path: Path) -> None:
    """Overlays appearing and vanishing on the host meanwhile (what other sandboxes do) do not matter."""
    import subprocess
    import threading

    stop = threading.Event()

    def churn() -> None:
        for i in range(10_000):
            if stop.is_set():
                return
            target = tmp_path / f"m{i}"
            target.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(target)], check=False, capture_output=True)
            subprocess.run(["umount", str(target)], check=False, capture_output=True)
            target.rmdir()

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20):
            assert check_host(SandboxConfig()).endswith("bwrap")
    finally:
        stop.set()
        thread.join()


def test_a_host_without_user_namespaces_fails_at_once_with_the_fix(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, failures=100, message="No permissions to creating new namespace")
    with pytest.raises(SandboxUnavailable, match="unprivileged user namespaces"):
        check_host(SandboxConfig(bwrap_path=bwrap))
    assert (tmp_path / "calls").read_text().strip() == "1"
