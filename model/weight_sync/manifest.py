"""The stored format of a version: key layout and the manifest that describes one rank's part.

A version is published by ``world_size`` ranks, each writing its own part of the state dict (a
disjoint set of tensors) as shard blobs plus a manifest, under its own folder::

    <prefix>/<run>/v0000000042/rank-00000-of-00002/manifest.json
    <prefix>/<run>/v0000000042/rank-00000-of-00002/shard-00000.bin
    <prefix>/<run>/v0000000042/rank-00001-of-00002/manifest.json
    ...

Versions are zero-padded so keys sort numerically. A rank's manifest is written after its shards
and deleted before them, so a manifest always names blobs that exist; a version exists for readers
once every rank's manifest does. Each rank's part forms its own chain: an anchor (every tensor
whole) every K versions and deltas against the rank's previous upload in between.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Literal

from model.weight_sync.errors import CorruptVersion

__all__ = [
    "FORMAT",
    "Encoding",
    "Manifest",
    "RankKey",
    "ShardEntry",
    "TensorEntry",
    "complete_world_sizes",
    "manifest_key",
    "parse_key",
    "rank_prefix",
    "run_prefix",
    "validate_run",
    "version_prefix",
]

FORMAT = "asyncrl.weight_sync.v2"
Encoding = Literal["raw", "xor", "xor_sparse", "same"]
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_KEY_RE = re.compile(r"/v(\d{10})/rank-(\d{5})-of-(\d{5})/([^/]+)$")


def validate_run(run: str) -> str:
    if not _RUN_RE.match(run):
        raise ValueError(f"run={run!r} must match {_RUN_RE.pattern} (it becomes part of blob keys)")
    return run


def run_prefix(key_prefix: str, run: str) -> str:
    return f"{key_prefix}/{run}/"


def version_prefix(key_prefix: str, run: str, version: int) -> str:
    return f"{run_prefix(key_prefix, run)}v{version:010d}/"


def rank_prefix(key_prefix: str, run: str, version: int, rank: int = 0, world_size: int = 1) -> str:
    return f"{version_prefix(key_prefix, run, version)}rank-{rank:05d}-of-{world_size:05d}/"


def manifest_key(key_prefix: str, run: str, version: int, rank: int = 0, world_size: int = 1) -> str:
    return rank_prefix(key_prefix, run, version, rank, world_size) + "manifest.json"


@dataclasses.dataclass(frozen=True)
class RankKey:
    """A parsed blob key of the weight tree."""

    key: str
    version: int
    rank: int
    world_size: int
    name: str

    @property
    def is_manifest(self) -> bool:
        return self.name == "manifest.json"


def parse_key(key: str) -> RankKey | None:
    """The version, rank and file of a weight-tree key; None for keys of any other layout."""
    match = _KEY_RE.search(key)
    if match is None:
        return None
    version, rank, world_size = (int(g) for g in match.groups()[:3])
    return RankKey(key, version, rank, world_size, match.group(4))


def complete_world_sizes(keys: Iterable[RankKey]) -> dict[int, set[int]]:
    """World size -> ranks whose manifest is among ``keys`` (of one version)."""
    ranks: dict[int, set[int]] = {}
    for key in keys:
        if key.is_manifest:
            ranks.setdefault(key.world_size, set()).add(key.rank)
    return ranks


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a rank's part: where its frames are and what its bits hash to."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    shard: int
    frames: tuple[tuple[int, int], ...]  # (offset, length) in the shard blob
    num_changed: int
    checksum: str
    base_checksum: str | None


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    key: str
    num_bytes: int
    checksum: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to fetch, check and rebuild one rank's part of one version."""

    run: str
    version: int
    rank: int
    world_size: int
    base_version: int | None
    anchor_version: int
    num_since_anchor: int
    state_checksum: str
    base_state_checksum: str | None
    zstd_level: int
    created_unix_s: float
    shards: tuple[ShardEntry, ...]
    tensors: tuple[TensorEntry, ...]

    @property
    def is_anchor(self) -> bool:
        return self.base_version is None

    @property
    def num_encoded_bytes(self) -> int:
        return sum(shard.num_bytes for shard in self.shards)

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate; raises CorruptVersion naming ``where``."""
        try:
            raw = json.loads(data)
            if raw.pop("format") != FORMAT:
                raise ValueError(f"format is not {FORMAT}")
            shards = tuple(ShardEntry(**shard) for shard in raw.pop("shards"))
            tensors = tuple(
                TensorEntry(**{**t, "shape": tuple(t["shape"]), "frames": tuple(tuple(f) for f in t["frames"])})
                for t in raw.pop("tensors")
            )
            manifest = cls(**raw, shards=shards, tensors=tensors)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptVersion(f"manifest {where} is malformed: {exc}") from exc
        _check_types(manifest, where)
        if manifest.base_version is not None and manifest.base_version >= manifest.version:
            raise CorruptVersion(
                f"manifest {where}: base_version {manifest.base_version} is not older than version {manifest.version}"
            )
        if not 0 <= manifest.rank < manifest.world_size:
            raise CorruptVersion(f"manifest {where}: rank {manifest.rank} outside world_size {manifest.world_size}")
        return manifest


def _check_types(manifest: Manifest, where: str) -> None:
    sizes = [manifest.version, manifest.anchor_version, manifest.num_since_anchor, manifest.rank, manifest.world_size]
    sizes += [manifest.base_version] if manifest.base_version is not None else []
    sizes += [shard.num_bytes for shard in manifest.shards]
    for tensor in manifest.tensors:
        sizes += [tensor.shard, tensor.num_changed, *tensor.shape, *(n for frame in tensor.frames for n in frame)]
        if type(tensor.shard) is int and not 0 <= tensor.shard < len(manifest.shards):
            raise CorruptVersion(f"manifest {where}: tensor {tensor.name!r} names missing shard {tensor.shard}")
    if type(manifest.zstd_level) is not int or not all(type(n) is int and n >= 0 for n in sizes):
        raise CorruptVersion(f"manifest {where} has a non-integer or negative version, size or offset")
