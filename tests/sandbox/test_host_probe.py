"""The host probe tells a mount-tree race with neighbouring sandboxes from a host without namespaces."""

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
    """A bwrap stand-in failing its first `failures` calls with `message`, then succeeding."""
    counter = tmp_path / "calls"
    counter.write_text("0")
    counter.chmod(0o666)
    script = tmp_path / "bwrap"
    script.write_text(f"""#!/bin/sh
n=$(cat {counter}); echo $((n + 1)) > {counter}
if [ "$n" -lt {failures} ]; then echo "bwrap: {message}" >&2; exit 1; fi
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)


def test_a_mount_race_with_neighbours_is_retried(tmp_path: Path) -> None:
    race = "Can't bind mount /oldroot/ on /newroot/: Unable to apply mount flags: No such file or directory"
    bwrap = _fake_bwrap(tmp_path, failures=2, message=race)
    assert check_host(SandboxConfig(bwrap_path=bwrap)) == bwrap
    assert (tmp_path / "calls").read_text().strip() == "3"


def test_a_host_without_user_namespaces_fails_at_once_with_the_fix(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, failures=100, message="No permissions to creating new namespace")
    with pytest.raises(SandboxUnavailable, match="unprivileged user namespaces"):
        check_host(SandboxConfig(bwrap_path=bwrap))
    assert (tmp_path / "calls").read_text().strip() == "1"
