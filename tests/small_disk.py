"""A real small file system for the tests of a full disk: a tmpfs of a few MiB mounted at a test's folder
(the tests run as root), filled to the last byte and freed again; and the file store with the errors of a
full disk injected below it (`FullDisk`), where a test needs the outage's length in its own hands."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.blob import BlobStoreConfig, FileBlobStore

__all__ = ["FullDisk", "fill", "small_tmpfs"]


class FullDisk(FileBlobStore):
    """The real store, its whole-object writes failing with ``errnos`` first."""

    def __init__(self, root: Path, errnos: list[int], max_full_s: float = 5.0, backoff_max_s: float = 0.01) -> None:
        super().__init__(BlobStoreConfig(url=root.as_uri(), backoff_base_s=min(0.001, backoff_max_s),
                                         backoff_max_s=backoff_max_s, max_full_s=max_full_s))
        self.errnos, self.num_calls = errnos, 0

    def _put_sync(self, *args: Any) -> None:
        self.num_calls += 1
        if self.errnos:
            code = self.errnos.pop(0)
            raise OSError(code, errno.errorcode[code])
        super()._put_sync(*args)


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """``path`` as the mount point of a tmpfs of ``size_bytes``; skips the test where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path, leave_bytes: int = 0) -> Path:
    """A file in ``folder`` that takes every free byte of its file system but ``leave_bytes`` (room for small
    writes, none for large ones); delete it to free the space."""
    filler = folder / "filler.bin"
    block = b"\0" * (64 * 1024)
    with open(filler, "wb", buffering=0) as handle:
        while True:
            try:
                handle.write(block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        with contextlib.suppress(OSError):  # the last partial block
            while handle.write(b"\0" * 512):
                pass
        if leave_bytes:
            handle.truncate(max(0, handle.tell() - leave_bytes))
    return filler
