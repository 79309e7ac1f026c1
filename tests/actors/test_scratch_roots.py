"""An actor kind's scratch root goes away with its last process; the stores' uid claims (one file per
host now) never keep it, nor does the claim file a store of the previous layout left in it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from pathlib import Path

import pytest

from actors.stages import scratch
from actors.stages.scratch import UID_CLAIMS, open_sandbox_store, scratch_root
from sandbox import SandboxUnavailable


def test_the_last_store_of_a_kind_removes_its_root(tmp_path: Path) -> None:
    root = scratch_root("uid-claims-test", tmp_path)
    with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
        try:
            one = open_sandbox_store("uid-claims-test", tmp_path, first)
        except SandboxUnavailable as e:
            pytest.skip(f"sandbox unavailable on this host: {e}")
        open_sandbox_store("uid-claims-test", tmp_path, second)
        assert one.ids is None or not (root / UID_CLAIMS).exists()  # the claims are the host's
        first.close()
        assert root.exists()  # the second still works here
    assert not root.exists()


def test_a_previous_layout_s_unheld_claim_file_does_not_keep_the_root(tmp_path: Path) -> None:
    root = tmp_path / "kind"
    root.mkdir()
    (root / UID_CLAIMS).touch(0o600)
    fd = os.open(root / UID_CLAIMS, os.O_RDWR)
    try:  # a store of that layout, still running, holds a uid's byte: the file and root stay
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 7, 1, 0))
        scratch._remove_if_empty(root)
        assert (root / UID_CLAIMS).exists()
    finally:
        os.close(fd)
    scratch._remove_if_empty(root)
    assert not root.exists()
