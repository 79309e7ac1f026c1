"""Encode and decode one rank's part of one version: tensors -> shard blobs + manifest, and back.

``encode_version`` turns a state (name -> tensor) into an anchor or a delta against the rank's
previous ``WeightState``; ``decode_version`` rebuilds the state bit for bit from the manifest, the
shard blobs and the exact base the delta names, or raises before anything is returned.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor

import numpy as np
import torch
import xxhash

from model.weight_sync.codec import (
    CodecConfig,
    EncodedTensor,
    checksum,
    decode_tensor,
    dtype_name,
    encode_tensor,
    from_bits,
    parse_dtype,
)
from model.weight_sync.errors import BaseMismatch, CorruptVersion
from model.weight_sync.manifest import Manifest, ShardEntry, TensorEntry, rank_prefix, validate_run

__all__ = ["EncodedVersion", "WeightState", "decode_version", "encode_version", "state_checksum"]


def state_checksum(entries: Mapping[str, tuple[str, tuple[int, ...], str]]) -> str:
    """One hash over (name, dtype, shape, bits checksum) of every tensor, in name order."""
    digest = xxhash.xxh3_128()
    for name in sorted(entries):
        dtype, shape, digest_hex = entries[name]
        digest.update(f"{name}\x00{dtype}\x00{shape}\x00{digest_hex}\x01".encode())
    return digest.hexdigest()


@dataclasses.dataclass
class WeightState:
    """A rank's part of a version with its checksums: the publisher's base and the reader's state.

    Tensors are shared, not copied: treat them as read-only (a modified base is detected by checksum).
    """

    version: int
    anchor_version: int
    num_since_anchor: int
    tensors: dict[str, torch.Tensor]
    checksums: dict[str, str]

    def state_checksum(self) -> str:
        return state_checksum(
            {name: (dtype_name(t.dtype), tuple(t.shape), self.checksums[name]) for name, t in self.tensors.items()}
        )


@dataclasses.dataclass(frozen=True)
class EncodedVersion:
    """A rank's part ready to upload: shard blobs (aligned with ``manifest.shards``) and the new base."""

    manifest: Manifest
    shards: tuple[bytes, ...]
    state: WeightState
    key_prefix: str

    @property
    def manifest_key(self) -> str:
        m = self.manifest
        return rank_prefix(self.key_prefix, m.run, m.version, m.rank, m.world_size) + "manifest.json"


def encode_version(
    state: Mapping[str, torch.Tensor],
    base: WeightState | None,
    *,
    run: str,
    version: int,
    config: CodecConfig,
    key_prefix: str = "weights",
    rank: int = 0,
    world_size: int = 1,
    executor: Executor | None = None,
) -> EncodedVersion:
    """Encode ``state`` as an anchor (base None or K reached) or as a delta against ``base``.

    Raises:
        ValueError: version not newer than the base, bad run name or rank, or an empty state.
    """
    validate_run(run)
    if not state:
        raise ValueError(f"state for version {version} has no tensors")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if base is not None and version <= base.version:
        raise ValueError(f"version {version} must be newer than its base version {base.version}")
    if base is not None and base.num_since_anchor + 1 >= config.anchor_every:
        base = None
    names = sorted(state)

    def work(name: str) -> EncodedTensor:
        old = None if base is None else base.tensors.get(name)
        old_checksum = None if base is None or old is None else base.checksums[name]
        return encode_tensor(name, state[name], old, old_checksum, config)

    encoded = list(executor.map(work, names)) if executor is not None else [work(n) for n in names]
    prefix = rank_prefix(key_prefix, run, version, rank, world_size)
    shards, shard_entries, tensor_entries = _assemble_shards(encoded, prefix, config.shard_bytes)
    new_state = WeightState(
        version=version,
        anchor_version=version if base is None else base.anchor_version,
        num_since_anchor=0 if base is None else base.num_since_anchor + 1,
        tensors={name: state[name] for name in names},
        checksums={item.name: item.checksum for item in encoded},
    )
    manifest = Manifest(
        run=run,
        version=version,
        rank=rank,
        world_size=world_size,
        base_version=None if base is None else base.version,
        anchor_version=new_state.anchor_version,
        num_since_anchor=new_state.num_since_anchor,
        state_checksum=new_state.state_checksum(),
        base_state_checksum=None if base is None else base.state_checksum(),
        zstd_level=config.zstd_level,
        created_unix_s=time.time(),
        shards=tuple(shard_entries),
        tensors=tuple(tensor_entries),
    )
    return EncodedVersion(manifest, tuple(shards), new_state, key_prefix)


def _assemble_shards(
    encoded: Sequence[EncodedTensor], prefix: str, shard_bytes: int
) -> tuple[list[bytes], list[ShardEntry], list[TensorEntry]]:
    groups: list[list[EncodedTensor]] = [[]]
    raw_in_group = 0
    for item in encoded:
        if groups[-1] and raw_in_group + item.num_raw_bytes > shard_bytes:
            groups.append([])
            raw_in_group = 0
        groups[-1].append(item)
        raw_in_group += item.num_raw_bytes
    shards, shard_entries, tensor_entries = [], [], []
    for index, group in enumerate(groups):
        pieces, offset = [], 0
        for item in group:
            frames = []
            for frame in item.frames:
                frames.append((offset, len(frame)))
                pieces.append(frame)
                offset += len(frame)
            meta = (item.name, item.dtype, item.shape, item.encoding, index, tuple(frames))
            tensor_entries.append(TensorEntry(*meta, item.num_changed, item.checksum, item.base_checksum))
        data = b"".join(pieces)
        shards.append(data)
        shard_entries.append(ShardEntry(f"{prefix}shard-{index:05d}.bin", len(data), checksum(data)))
    return shards, shard_entries, tensor_entries


def check_base(manifest: Manifest, base: WeightState | None) -> None:
    """Raise BaseMismatch unless ``base`` is exactly the state a delta manifest was encoded against."""
    if manifest.is_anchor:
        return
    if base is None or base.version != manifest.base_version:
        have = None if base is None else base.version
        raise BaseMismatch(
            f"version {manifest.version} is a delta against version {manifest.base_version}, but the "
            f"base offered is version {have}; fetch from an anchor or replay the chain in order"
        )
    if base.state_checksum() != manifest.base_state_checksum:
        raise BaseMismatch(
            f"version {manifest.version}: base version {base.version} has state checksum "
            f"{base.state_checksum()}, the delta expects {manifest.base_state_checksum}"
        )


def _check_shards(manifest: Manifest, shards: Sequence[bytes]) -> None:
    if len(shards) != len(manifest.shards):
        raise CorruptVersion(f"version {manifest.version}: {len(shards)} shards for {len(manifest.shards)}")
    for index, (entry, blob) in enumerate(zip(manifest.shards, shards, strict=True)):
        if len(blob) != entry.num_bytes:
            raise CorruptVersion(
                f"version {manifest.version} shard {index} ({entry.key}) is truncated or padded: "
                f"{len(blob)} bytes, manifest says {entry.num_bytes}"
            )
        if checksum(blob) != entry.checksum:
            raise CorruptVersion(f"version {manifest.version} shard {index} ({entry.key}) fails its checksum")


def decode_version(
    manifest: Manifest,
    shards: Sequence[bytes],
    base: WeightState | None,
    *,
    executor: Executor | None = None,
) -> WeightState:
    """Rebuild a rank's part of a version bit for bit from its shards and (for a delta) its exact base.

    Raises:
        BaseMismatch: ``base`` is not the version, or not the bits, the delta was encoded against.
        CorruptVersion: a shard is truncated or damaged, or a rebuilt tensor fails its checksum.
    """
    check_base(manifest, base)
    _check_shards(manifest, shards)
    views = [memoryview(blob) for blob in shards]

    def work(entry: TensorEntry) -> np.ndarray:
        old = None if base is None else base.tensors.get(entry.name)
        return decode_tensor(entry, views[entry.shard], old)

    entries = manifest.tensors
    rebuilt = list(executor.map(work, entries)) if executor is not None else [work(e) for e in entries]
    state = WeightState(
        version=manifest.version,
        anchor_version=manifest.anchor_version,
        num_since_anchor=manifest.num_since_anchor,
        tensors={e.name: from_bits(b, parse_dtype(e.dtype), e.shape) for e, b in zip(entries, rebuilt, strict=True)},
        checksums={entry.name: entry.checksum for entry in entries},
    )
    if state.state_checksum() != manifest.state_checksum:
        raise CorruptVersion(f"version {manifest.version}: rebuilt state fails the manifest's state checksum")
    return state
