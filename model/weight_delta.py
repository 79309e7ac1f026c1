"""Weight delta codec, publisher and subscriber: trainer -> blob store -> rollout actors.

Each published version is either an *anchor* (every tensor stored whole) or a *delta* against the
version the same publisher uploaded just before it. A delta stores, per tensor, the XOR of the raw
bits against the base (dense, or sparse as a changed-element bitmap plus the changed XOR words),
or the raw bits (overwrite) when that is smaller, or nothing when the tensor is unchanged. Every
payload is a zstd frame. Checksums are xxh3-128 of a tensor's raw bits (per tensor, for the base
and the result) and of each shard blob, so a reader detects a corrupt, truncated, missing or
out-of-order delta before anything is applied, and rebuilds every version bit for bit.

Key layout in the store (zero-padded versions sort numerically; the manifest is written last, so a
version without its manifest does not exist for readers, and GC deletes the manifest first):

    <prefix>/<run>/v0000000042/manifest.json
    <prefix>/<run>/v0000000042/shard-00000.bin

This module is single-process library code: it takes any object with async ``put/get/list/delete``
(``runtime.blob.BlobStore`` fits) and never imports the runtime. Missing keys must raise KeyError
and transient store failures OSError (ConnectionError), which the publisher and subscriber retry.
The manifest and shard checksums use ``xxhash.xxh3_128``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Literal, Protocol, Self, TypeVar

import numpy as np
import structlog
import torch
import xxhash
import zstandard

__all__ = [
    "BaseMismatch",
    "BlobStoreLike",
    "CodecConfig",
    "CorruptVersion",
    "EncodedVersion",
    "Manifest",
    "PublishFailed",
    "PublishedVersion",
    "PublisherConfig",
    "SubscriberConfig",
    "TensorEntry",
    "VersionUnavailable",
    "WeightPublisher",
    "WeightState",
    "WeightSubscriber",
    "WeightSyncError",
    "decode_version",
    "encode_version",
    "manifest_key",
]

log = structlog.get_logger(__name__)

FORMAT = "asyncrl.weight_delta.v1"
MiB = 1024 * 1024
Encoding = Literal["raw", "xor", "xor_sparse", "same"]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
T = TypeVar("T")


class WeightSyncError(Exception):
    """Base class of weight-sync errors."""


class BaseMismatch(WeightSyncError, ValueError):
    """A delta was offered a base other than the one it was encoded against."""


class CorruptVersion(WeightSyncError, ValueError):
    """A manifest or shard failed validation: bad checksum, truncated, malformed or mislabelled."""


class VersionUnavailable(WeightSyncError, LookupError):
    """The requested version, or a version its chain needs, is not in the store."""


class PublishFailed(WeightSyncError, RuntimeError):
    """A version was not published (storage kept failing, its base failed, or a newer one replaced it)."""


class BlobStoreLike(Protocol):
    """What the publisher and subscriber need from a blob store."""

    async def put(self, key: str, data: bytes) -> None: ...
    async def get(self, key: str) -> bytes: ...
    async def list(self, prefix: str = "") -> list[str]: ...
    async def delete(self, key: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """How versions are encoded.

    Args:
        anchor_every: K; a full anchor every K versions of a chain (1 = anchors only).
        zstd_level: zstd compression level (1-3 is the usual trade-off for deltas).
        zstd_threads: zstd's own worker threads per frame (0 = compress in the calling thread).
        workers: tensors encoded or decoded in parallel.
        shard_bytes: raw tensor bytes per shard blob (a tensor is never split).
        sparse_max_fraction: changed-element fraction up to which the bitmap+values XOR is used.
        overwrite_min_fraction: changed fraction from which raw bits are also tried (smaller wins).
    """

    anchor_every: int = 10
    zstd_level: int = 1
    zstd_threads: int = 0
    workers: int = 2
    shard_bytes: int = 256 * MiB
    sparse_max_fraction: float = 0.25
    overwrite_min_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every={self.anchor_every} must be >= 1 (1 = every version full)")
        if not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level} must be in [-7, 22]; 1 suits deltas")
        if self.zstd_threads < 0 or self.workers < 1:
            raise ValueError(f"zstd_threads={self.zstd_threads} must be >= 0, workers={self.workers} >= 1")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes={self.shard_bytes} must be >= 1")
        if not 0.0 <= self.sparse_max_fraction <= 1.0 or not 0.0 <= self.overwrite_min_fraction <= 1.0:
            raise ValueError(
                f"sparse_max_fraction={self.sparse_max_fraction} and overwrite_min_fraction="
                f"{self.overwrite_min_fraction} must lie in [0, 1]"
            )


def _validate_run(run: str) -> str:
    if not _RUN_RE.match(run):
        raise ValueError(f"run={run!r} must match {_RUN_RE.pattern} (it becomes part of blob keys)")
    return run


def version_prefix(key_prefix: str, run: str, version: int) -> str:
    return f"{key_prefix}/{run}/v{version:010d}/"


def manifest_key(key_prefix: str, run: str, version: int) -> str:
    return version_prefix(key_prefix, run, version) + "manifest.json"


# -- manifest ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: where its frames are and what its bits hash to."""

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
    """Everything a reader needs to fetch, check and rebuild one version."""

    run: str
    version: int
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
        _check_manifest_types(manifest, where)
        if manifest.base_version is not None and manifest.base_version >= manifest.version:
            raise CorruptVersion(
                f"manifest {where}: base_version {manifest.base_version} is not older than version {manifest.version}"
            )
        return manifest


def _check_manifest_types(manifest: Manifest, where: str) -> None:
    sizes = [manifest.version, manifest.anchor_version, manifest.num_since_anchor]
    sizes += [manifest.base_version] if manifest.base_version is not None else []
    sizes += [shard.num_bytes for shard in manifest.shards]
    for tensor in manifest.tensors:
        sizes += [tensor.shard, tensor.num_changed, *tensor.shape, *(n for frame in tensor.frames for n in frame)]
        if type(tensor.shard) is int and not 0 <= tensor.shard < len(manifest.shards):
            raise CorruptVersion(f"manifest {where}: tensor {tensor.name!r} names missing shard {tensor.shard}")
    if type(manifest.zstd_level) is not int or not all(type(n) is int and n >= 0 for n in sizes):
        raise CorruptVersion(f"manifest {where} has a non-integer or negative version, size or offset")


# -- bits, checksums, frames ---------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as a flat integer array (shares memory when already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    view = _INT_VIEW.get(flat.element_size(), torch.uint8)
    return flat.view(view).numpy()


def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.from_numpy(bits).view(dtype).reshape(tuple(shape))


def _checksum(buffer: np.ndarray | bytes | memoryview) -> str:
    return xxhash.xxh3_128(buffer).hexdigest()


def _state_checksum(entries: Mapping[str, tuple[str, tuple[int, ...], str]]) -> str:
    digest = xxhash.xxh3_128()
    for name in sorted(entries):
        dtype, shape, checksum = entries[name]
        digest.update(f"{name}\x00{dtype}\x00{shape}\x00{checksum}\x01".encode())
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptVersion(f"unknown dtype {name!r} in manifest")
    return dtype


def _decompress(frame: memoryview, expected: int, what: str) -> bytes:
    try:
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(expected, 1))
    except zstandard.ZstdError as exc:
        raise CorruptVersion(f"{what}: zstd frame is damaged ({exc})") from exc
    if len(data) != expected:
        raise CorruptVersion(f"{what}: expected {expected} decompressed bytes, got {len(data)}")
    return data


@dataclasses.dataclass
class WeightState:
    """A version's tensors with their checksums: the publisher's base cache and the reader's state.

    Tensors are shared, not copied: treat them as read-only (a modified base is detected by checksum).
    """

    version: int
    anchor_version: int
    num_since_anchor: int
    tensors: dict[str, torch.Tensor]
    checksums: dict[str, str]

    def state_checksum(self) -> str:
        return _state_checksum(
            {name: (_dtype_name(t.dtype), tuple(t.shape), self.checksums[name]) for name, t in self.tensors.items()}
        )


@dataclasses.dataclass(frozen=True)
class _EncodedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    frames: tuple[bytes, ...]
    num_raw_bytes: int
    num_changed: int
    checksum: str
    base_checksum: str | None


_CHUNK = 1 << 16  # elements per step of the sparse XOR loops: temporaries stay in cache


def _planes(bits: np.ndarray) -> np.ndarray:
    """Byte planes (all first bytes, then all second bytes, ...): exponent bytes compress well."""
    if bits.dtype.itemsize == 1:
        return bits
    return np.ascontiguousarray(bits.view(np.uint8).reshape(-1, bits.dtype.itemsize).T)


def _unplanes(data: bytes, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(data, np.uint8).reshape(dtype.itemsize, -1)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1)


def _sparse_xor(bits: np.ndarray, base_bits: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(packed changed-element bitmap, changed XOR words), or None once more than ``limit`` changed."""
    n = bits.size
    scratch_x, scratch_m = np.empty(min(n, _CHUNK), bits.dtype), np.empty(min(n, _CHUNK), bool)
    packed = np.empty((n + 7) // 8, np.uint8)
    values, count = [], 0
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        x, m = scratch_x[: stop - start], scratch_m[: stop - start]
        np.bitwise_xor(bits[start:stop], base_bits[start:stop], out=x)
        np.not_equal(x, 0, out=m)
        packed[start // 8 : (stop + 7) // 8] = np.packbits(m)
        values.append(x[m])
        count += values[-1].size
        if count > limit:
            return None
    return packed, np.concatenate(values)


def _apply_sparse_xor(base_bits: np.ndarray, packed: np.ndarray, values: np.ndarray, what: str) -> np.ndarray:
    n = base_bits.size
    out, dense = np.empty_like(base_bits), np.empty(min(n, _CHUNK), base_bits.dtype)
    offset = 0
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        m = np.unpackbits(packed[start // 8 : (stop + 7) // 8], count=stop - start).view(bool)
        count = int(np.count_nonzero(m))
        if offset + count > values.size:
            raise CorruptVersion(f"{what}: bitmap marks more changes than the {values.size} stored")
        d = dense[: stop - start]
        d.fill(0)
        d[m] = values[offset : offset + count]
        offset += count
        np.bitwise_xor(base_bits[start:stop], d, out=out[start:stop])
    if offset != values.size:
        raise CorruptVersion(f"{what}: bitmap marks {offset} changes, {values.size} stored")
    return out


def _encode_tensor(name: str, tensor: torch.Tensor, base: WeightState | None, config: CodecConfig) -> _EncodedTensor:
    bits = _bits(tensor)
    checksum = _checksum(bits)
    compressor = zstandard.ZstdCompressor(level=config.zstd_level, threads=config.zstd_threads, write_checksum=True)
    meta = (name, _dtype_name(tensor.dtype), tuple(tensor.shape))
    base_tensor = None if base is None else base.tensors.get(name)
    if base_tensor is None or base_tensor.dtype != tensor.dtype or base_tensor.shape != tensor.shape:
        frame = compressor.compress(_planes(bits))
        return _EncodedTensor(*meta, "raw", (frame,), bits.nbytes, bits.size, checksum, None)
    assert base is not None
    base_checksum = base.checksums[name]
    if checksum == base_checksum:
        return _EncodedTensor(*meta, "same", (), bits.nbytes, 0, checksum, base_checksum)
    base_bits = _bits(base_tensor)
    sparse = _sparse_xor(bits, base_bits, int(config.sparse_max_fraction * bits.size))
    if sparse is not None:
        packed, values = sparse
        frames = (compressor.compress(packed), compressor.compress(values))
        return _EncodedTensor(*meta, "xor_sparse", frames, bits.nbytes, values.size, checksum, base_checksum)
    delta = np.bitwise_xor(bits, base_bits)
    num_changed = int(np.count_nonzero(delta))
    frames, encoding = (compressor.compress(_planes(delta)),), "xor"
    if num_changed >= config.overwrite_min_fraction * bits.size:
        raw = compressor.compress(_planes(bits))
        if len(raw) < len(frames[0]):
            frames, encoding = (raw,), "raw"
    return _EncodedTensor(*meta, encoding, frames, bits.nbytes, num_changed, checksum, base_checksum)


# -- encode / decode one version -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EncodedVersion:
    """A version ready to upload: shard blobs (aligned with ``manifest.shards``) and the new base."""

    manifest: Manifest
    shards: tuple[bytes, ...]
    state: WeightState

    @property
    def manifest_key(self) -> str:
        return self.shards_prefix + "manifest.json"

    @property
    def shards_prefix(self) -> str:
        return self.manifest.shards[0].key.rpartition("/")[0] + "/" if self.manifest.shards else ""


def encode_version(
    state: Mapping[str, torch.Tensor],
    base: WeightState | None,
    *,
    run: str,
    version: int,
    config: CodecConfig,
    key_prefix: str = "weights",
    executor: Executor | None = None,
) -> EncodedVersion:
    """Encode ``state`` as an anchor (base None or K reached) or as a delta against ``base``.

    Raises:
        ValueError: version not newer than the base, bad run name, or an empty state.
    """
    _validate_run(run)
    if not state:
        raise ValueError(f"state for version {version} has no tensors")
    if base is not None and version <= base.version:
        raise ValueError(f"version {version} must be newer than its base version {base.version}")
    if base is not None and base.num_since_anchor + 1 >= config.anchor_every:
        base = None
    names = sorted(state)
    work = [(name, state[name], base, config) for name in names]
    if executor is None:
        encoded = [_encode_tensor(*item) for item in work]
    else:
        encoded = list(executor.map(lambda item: _encode_tensor(*item), work))
    prefix = version_prefix(key_prefix, run, version)
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
    return EncodedVersion(manifest, tuple(shards), new_state)


def _assemble_shards(
    encoded: Sequence[_EncodedTensor], prefix: str, shard_bytes: int
) -> tuple[list[bytes], list[ShardEntry], list[TensorEntry]]:
    groups: list[list[_EncodedTensor]] = [[]]
    raw_in_group = 0
    for item in encoded:
        if groups[-1] and raw_in_group + item.num_raw_bytes > shard_bytes:
            groups.append([])
            raw_in_group = 0
        groups[-1].append(item)
        raw_in_group += item.num_raw_bytes
    shards, shard_entries, tensor_entries = [], [], []
    for index, group in enumerate(groups):
        blob, offset = bytearray(), 0
        for item in group:
            frames = []
            for frame in item.frames:
                frames.append((offset, len(frame)))
                blob += frame
                offset += len(frame)
            tensor_entries.append(
                TensorEntry(
                    item.name,
                    item.dtype,
                    item.shape,
                    item.encoding,
                    index,
                    tuple(frames),
                    item.num_changed,
                    item.checksum,
                    item.base_checksum,
                )
            )
        data = bytes(blob)
        shards.append(data)
        shard_entries.append(ShardEntry(f"{prefix}shard-{index:05d}.bin", len(data), _checksum(data)))
    return shards, shard_entries, tensor_entries


def _check_base(manifest: Manifest, base: WeightState | None) -> None:
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


def _decode_tensor(entry: TensorEntry, shard: memoryview, base: WeightState | None) -> np.ndarray:
    what = f"tensor {entry.name!r}"
    dtype = _parse_dtype(entry.dtype)
    numel = int(np.prod(entry.shape, dtype=np.int64))
    itemsize = torch.empty((), dtype=dtype).element_size()
    view = _INT_VIEW.get(itemsize, torch.uint8)
    np_dtype = torch.empty(0, dtype=view).numpy().dtype
    count = numel * (1 if itemsize in _INT_VIEW else itemsize)
    frames = [shard[offset : offset + length] for offset, length in entry.frames]
    if any(len(frame) != length for frame, (_, length) in zip(frames, entry.frames, strict=True)):
        raise CorruptVersion(f"{what}: frames run past the end of shard {entry.shard}")
    base_bits = None
    if entry.encoding != "raw":
        if base is None or entry.name not in base.tensors:
            raise BaseMismatch(f"{what} is encoded as {entry.encoding!r} but the base lacks it")
        base_bits = _bits(base.tensors[entry.name])
        if base_bits.size != count or _checksum(base_bits) != entry.base_checksum:
            raise BaseMismatch(f"{what}: base bits differ from the ones the delta was encoded against")
    nbytes = count * np_dtype.itemsize
    if entry.encoding == "raw":
        bits = _unplanes(_decompress(frames[0], nbytes, what), np_dtype)
    elif entry.encoding == "same":
        bits = base_bits
    elif entry.encoding == "xor":
        bits = np.bitwise_xor(base_bits, _unplanes(_decompress(frames[0], nbytes, what), np_dtype))
    elif entry.encoding == "xor_sparse":
        packed = np.frombuffer(_decompress(frames[0], (count + 7) // 8, what), np.uint8)
        values = np.frombuffer(_decompress(frames[1], entry.num_changed * np_dtype.itemsize, what), np_dtype)
        bits = _apply_sparse_xor(base_bits, packed, values, what)
    else:
        raise CorruptVersion(f"{what}: unknown encoding {entry.encoding!r}")
    if _checksum(bits) != entry.checksum:
        raise CorruptVersion(f"{what}: rebuilt bits fail checksum {entry.checksum}")
    return bits


def decode_version(
    manifest: Manifest,
    shards: Sequence[bytes],
    base: WeightState | None,
    *,
    executor: Executor | None = None,
) -> WeightState:
    """Rebuild a version bit for bit from its shards and (for a delta) the exact base it names.

    Raises:
        BaseMismatch: ``base`` is not the version, or not the bits, the delta was encoded against.
        CorruptVersion: a shard is truncated or damaged, or a rebuilt tensor fails its checksum.
    """
    _check_base(manifest, base)
    if len(shards) != len(manifest.shards):
        raise CorruptVersion(f"version {manifest.version}: {len(shards)} shards for {len(manifest.shards)}")
    for index, (entry, blob) in enumerate(zip(manifest.shards, shards, strict=True)):
        if len(blob) != entry.num_bytes:
            raise CorruptVersion(
                f"version {manifest.version} shard {index} ({entry.key}) is truncated or padded: "
                f"{len(blob)} bytes, manifest says {entry.num_bytes}"
            )
        if _checksum(blob) != entry.checksum:
            raise CorruptVersion(f"version {manifest.version} shard {index} ({entry.key}) fails its checksum")
    views = [memoryview(blob) for blob in shards]

    def work(entry: TensorEntry) -> np.ndarray:
        return _decode_tensor(entry, views[entry.shard], base)

    entries = manifest.tensors
    bits = list(executor.map(work, entries)) if executor is not None else [work(e) for e in entries]
    tensors = {
        entry.name: _from_bits(b, _parse_dtype(entry.dtype), entry.shape)
        for entry, b in zip(entries, bits, strict=True)
    }
    state = WeightState(
        version=manifest.version,
        anchor_version=manifest.anchor_version,
        num_since_anchor=manifest.num_since_anchor,
        tensors=tensors,
        checksums={entry.name: entry.checksum for entry in entries},
    )
    if state.state_checksum() != manifest.state_checksum:
        raise CorruptVersion(f"version {manifest.version}: rebuilt state fails the manifest's state checksum")
    return state


# -- storage helpers -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Retry:
    attempts: int
    base_s: float
    max_s: float

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError(
                f"max_attempts={self.attempts}, backoff_base_s={self.base_s}, backoff_max_s={self.max_s}: "
                "need attempts >= 1 and 0 <= base <= max"
            )

    async def run(self, op: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()``, retrying OSError (transient storage failures) with backoff."""
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except OSError as exc:
                if attempt == self.attempts:
                    raise
                cap = min(self.max_s, self.base_s * 2 ** (attempt - 1))
                delay_s = cap / 2 + random.uniform(0, cap / 2)
                log.warning("weights_storage_retry", op=op, key=key, attempt=attempt, delay_s=delay_s, error=str(exc))
                await asyncio.sleep(delay_s)
        raise AssertionError("unreachable")  # pragma: no cover


_VERSION_KEY_RE = re.compile(r"/v(\d{10})/([^/]+)$")


def _keys_by_version(keys: Sequence[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for key in keys:
        match = _VERSION_KEY_RE.search(key)
        if match:
            out.setdefault(int(match.group(1)), []).append(key)
    return out


# -- publisher -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublisherConfig:
    """Publisher settings.

    Args:
        run: run name (part of every key).
        codec: how versions are encoded.
        key_prefix: first key segment of the weight tree.
        retain_versions: newest published versions kept; older ones are deleted unless a kept
            version's chain still needs them (its anchor and the deltas after it).
        max_pending: snapshots waiting for the encoder; beyond it the oldest waiting one is dropped
            (superseded) so the training step never waits. Deltas are always taken against the
            last encoded version, so the chain stays whole.
        max_attempts, backoff_base_s, backoff_max_s: retries of transient storage errors.
        upload_concurrency: shard uploads in flight.
    """

    run: str
    codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)
    key_prefix: str = "weights"
    retain_versions: int = 16
    max_pending: int = 2
    max_attempts: int = 5
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0
    upload_concurrency: int = 4

    def __post_init__(self) -> None:
        _validate_run(self.run)
        _Retry(self.max_attempts, self.backoff_base_s, self.backoff_max_s)
        if self.retain_versions < 1 or self.max_pending < 1 or self.upload_concurrency < 1:
            raise ValueError(
                f"retain_versions={self.retain_versions}, max_pending={self.max_pending}, "
                f"upload_concurrency={self.upload_concurrency} must all be >= 1"
            )


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    version: int
    base_version: int | None
    manifest_key: str
    num_weight_bytes: int
    num_encoded_bytes: int
    encode_s: float
    upload_s: float


@dataclasses.dataclass(frozen=True)
class _Job:
    version: int
    state: Mapping[str, torch.Tensor]
    future: asyncio.Future[PublishedVersion]


class WeightPublisher:
    """Encodes and uploads versions in the background; ``submit`` never waits for either.

    Use ``async with WeightPublisher(store, config) as publisher:``; ``submit(version, state)``
    takes ownership of the tensors (pass a fresh copy, e.g. the bf16 cast of the fp32 masters) and
    returns a future resolved once the manifest is written. Encoding of one version overlaps the
    upload of the previous one. Leaving the context publishes everything still pending.
    """

    def __init__(self, store: BlobStoreLike, config: PublisherConfig) -> None:
        self.store, self.config = store, config
        self._retry = _Retry(config.max_attempts, config.backoff_base_s, config.backoff_max_s)
        self._pending: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._encoded: asyncio.Queue[tuple[_Job, EncodedVersion, float] | None] = asyncio.Queue(maxsize=1)
        self._futures: set[asyncio.Future[PublishedVersion]] = set()
        self._base: WeightState | None = None
        self._failed: set[int] = set()
        self._anchor_of: dict[int, int] = {}  # versions published by this publisher -> their anchor
        self._known: list[int] | None = None  # versions in the store (any publisher), once listed
        self._last_version: int | None = None
        self._spare: list[dict[str, torch.Tensor]] = []  # retired snapshot buffers, reused by snapshot()
        self._owned: set[int] = set()  # ids of buffers snapshot() made (only those are ever reused)
        self._stack: contextlib.AsyncExitStack | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._status: Literal["new", "running", "closing", "closed"] = "new"
        self._log = log.bind(run=config.run)

    async def __aenter__(self) -> Self:
        if self._status != "new":
            raise RuntimeError(f"WeightPublisher is {self._status}; expected new (it is not reusable)")
        self._pool = ThreadPoolExecutor(self.config.codec.workers, thread_name_prefix="weights-encode")
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self._pool.shutdown)
            tasks = await stack.enter_async_context(asyncio.TaskGroup())
            tasks.create_task(self._encode_loop(), name="weights-encode")
            tasks.create_task(self._upload_loop(), name="weights-upload")
            self._stack = stack.pop_all()
        self._status = "running"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Publish everything submitted, stop the workers; idempotent."""
        if self._stack is None:
            return
        self._status = "closing"
        self._wake.set()
        stack, self._stack = self._stack, None
        await stack.aclose()
        self._status = "closed"

    def snapshot(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = torch.bfloat16
    ) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` (floating ones cast to ``dtype``) into buffers of a retired version.

        Cheap enough for every training step: reusing buffers avoids faulting in fresh memory for
        each copy. Pass the result to :meth:`submit`; the publisher recycles it once it is no
        longer needed as a delta base.
        """
        spare = self._spare.pop() if self._spare else {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            want = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            buffer = spare.pop(name, None)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != want:
                buffer = torch.empty(tensor.shape, dtype=want)
                self._owned.add(id(buffer))
            out[name] = buffer.copy_(tensor.detach())
        self._owned.difference_update(id(t) for t in spare.values())  # dropped with ``spare``
        return out

    def _retire(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep a no-longer-needed snapshot for reuse if snapshot() made every tensor in it."""
        if len(self._spare) < 2 and tensors and all(id(t) in self._owned for t in tensors.values()):
            self._spare.append(dict(tensors))
        else:
            self._owned.difference_update(id(t) for t in tensors.values())

    def submit(self, version: int, state: Mapping[str, torch.Tensor]) -> asyncio.Future[PublishedVersion]:
        """Queue ``state`` as ``version``; returns at once. The future fails with PublishFailed."""
        if self._status != "running":
            raise RuntimeError(f"submit() needs a running WeightPublisher; it is {self._status}")
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version {version} must be greater than the last submitted {self._last_version}")
        self._last_version = version
        future: asyncio.Future[PublishedVersion] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are logged
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        if len(self._pending) >= self.config.max_pending:
            dropped = self._pending.popleft()
            self._log.warning("weights_version_superseded", version=dropped.version, by=version)
            dropped.future.set_exception(PublishFailed(f"version {dropped.version} superseded by {version}"))
            self._retire(dropped.state)
        self._pending.append(_Job(version, state, future))
        self._wake.set()
        return future

    async def flush(self) -> None:
        """Wait until every submitted version is published or has failed."""
        await asyncio.gather(*list(self._futures), return_exceptions=True)

    async def _encode_loop(self) -> None:
        while True:
            while not self._pending:
                if self._status == "closing":
                    await self._encoded.put(None)
                    return
                self._wake.clear()
                await self._wake.wait()
            job = self._pending.popleft()
            base = self._base
            if base is not None and any(base.anchor_version <= v <= base.version for v in self._failed):
                base = None  # its chain has a version readers cannot get: start a new anchor
            started = time.perf_counter()
            try:
                encoded = await asyncio.to_thread(
                    encode_version,
                    job.state,
                    base,
                    run=self.config.run,
                    version=job.version,
                    config=self.config.codec,
                    key_prefix=self.config.key_prefix,
                    executor=self._pool,
                )
            except Exception as exc:
                self._log.exception("weights_encode_failed", version=job.version)
                job.future.set_exception(PublishFailed(f"encoding version {job.version} failed: {exc}"))
                continue
            if self._base is not None:
                self._retire(self._base.tensors)
            self._base = encoded.state
            await self._encoded.put((job, encoded, time.perf_counter() - started))

    async def _upload_loop(self) -> None:
        while (item := await self._encoded.get()) is not None:
            job, encoded, encode_s = item
            manifest = encoded.manifest
            broken = [v for v in self._failed if manifest.anchor_version <= v < manifest.version]
            if not manifest.is_anchor and broken:
                self._failed.add(manifest.version)
                job.future.set_exception(PublishFailed(f"version {manifest.version}: chain broken at {broken}"))
                continue
            started = time.perf_counter()
            try:
                await self._upload(encoded)
            except Exception as exc:
                self._failed.add(manifest.version)
                self._log.error("weights_upload_failed", version=manifest.version, error=str(exc))
                job.future.set_exception(PublishFailed(f"uploading version {manifest.version} failed: {exc}"))
                continue
            result = PublishedVersion(
                version=manifest.version,
                base_version=manifest.base_version,
                manifest_key=encoded.manifest_key,
                num_weight_bytes=sum(t.nbytes for t in encoded.state.tensors.values()),
                num_encoded_bytes=manifest.num_encoded_bytes,
                encode_s=encode_s,
                upload_s=time.perf_counter() - started,
            )
            self._anchor_of[manifest.version] = manifest.anchor_version
            if self._known is not None:
                self._known.append(manifest.version)
            self._log.info("weights_published", **dataclasses.asdict(result))
            job.future.set_result(result)
            await self._collect_garbage()

    async def _upload(self, encoded: EncodedVersion) -> None:
        limit = asyncio.Semaphore(self.config.upload_concurrency)

        async def put(key: str, data: bytes) -> None:
            async with limit:
                await self._retry.run("put", key, lambda: self.store.put(key, data))

        shards = zip(encoded.manifest.shards, encoded.shards, strict=True)
        await asyncio.gather(*(put(entry.key, blob) for entry, blob in shards))
        await put(encoded.manifest_key, encoded.manifest.to_json())  # last: the version now exists

    async def _collect_garbage(self) -> None:
        cfg = self.config
        try:
            if self._known is None:  # first time: learn what earlier publishers of this run left
                keys = await self._retry.run("list", cfg.run, lambda: self.store.list(f"{cfg.key_prefix}/{cfg.run}/"))
                self._known = sorted(_keys_by_version(keys))
            published = sorted(self._anchor_of)
            if len(published) <= cfg.retain_versions:
                return
            oldest = published[-cfg.retain_versions]
            root = self._anchor_of[oldest]
            doomed = [v for v in self._known if v < root]
            self._known = [v for v in self._known if v >= root]
            for version in doomed:
                await self._delete_version(version)
            if doomed:
                self._log.info("weights_gc", deleted=doomed, kept_from=root, oldest_retained=oldest)
        except (OSError, KeyError, WeightSyncError) as exc:
            self._log.warning("weights_gc_failed", error=str(exc))

    async def _delete_version(self, version: int) -> None:
        prefix = version_prefix(self.config.key_prefix, self.config.run, version)
        keys = await self._retry.run("list", prefix, lambda: self.store.list(prefix))
        for key in sorted(keys, key=lambda k: not k.endswith("/manifest.json")):
            # manifest first: a reader never sees a version whose shards are gone
            await self._retry.run("delete", key, lambda key=key: self.store.delete(key))
        self._anchor_of.pop(version, None)


# -- subscriber ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SubscriberConfig:
    """Subscriber settings: run, key prefix, decode workers, retries of transient storage errors."""

    run: str
    key_prefix: str = "weights"
    workers: int = 2
    max_attempts: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        _validate_run(self.run)
        _Retry(self.max_attempts, self.backoff_base_s, self.backoff_max_s)
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1")


class WeightSubscriber:
    """Fetches versions and rebuilds them bit for bit, holding the last good one as its base.

    ``fetch(v)`` walks the chain back from ``v`` (manifests only) until it reaches the version it
    already holds or an anchor, so a reader that fell behind an anchor jumps to it, then downloads,
    verifies and applies each step. Any failure (missing, corrupt, truncated or out-of-order
    version) raises before anything is applied; the held state stays the last good version and a
    later fetch past the next anchor recovers.
    """

    def __init__(self, store: BlobStoreLike, config: SubscriberConfig) -> None:
        self.store, self.config = store, config
        self._retry = _Retry(config.max_attempts, config.backoff_base_s, config.backoff_max_s)
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="weights-decode")
        self._state: WeightState | None = None
        self._fetching = asyncio.Lock()  # one fetch at a time: each continues from the held state
        self._log = log.bind(run=config.run)

    @property
    def version(self) -> int | None:
        return None if self._state is None else self._state.version

    @property
    def state(self) -> WeightState | None:
        return self._state

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def versions(self) -> list[int]:
        """Published versions (those whose manifest exists), oldest first."""
        prefix = f"{self.config.key_prefix}/{self.config.run}/"
        keys = await self._retry.run("list", prefix, lambda: self.store.list(prefix))
        by_version = _keys_by_version(keys)
        return sorted(v for v, ks in by_version.items() if any(k.endswith("/manifest.json") for k in ks))

    async def latest_version(self) -> int | None:
        published = await self.versions()
        return published[-1] if published else None

    async def fetch(self, target: int) -> dict[str, torch.Tensor]:
        """Rebuild ``target`` and make it the held state; returns its tensors (read-only).

        Raises:
            VersionUnavailable: ``target`` or a version its chain needs is missing.
            CorruptVersion: a manifest or shard on the chain failed validation.
            BaseMismatch: the chain does not continue from the state it starts from.
        """
        async with self._fetching:
            return await self._fetch(target)

    async def _fetch(self, target: int) -> dict[str, torch.Tensor]:
        if self._state is not None and self._state.version == target:
            return self._state.tensors
        started = time.perf_counter()
        chain = await self._plan(target)
        state = self._state if not chain[0].is_anchor else None
        self._log.info(
            "weights_fetch_planned", target=target, held=self.version, start=chain[0].version,
            from_anchor=state is None, num_steps=len(chain),
        )  # fmt: skip
        for manifest in chain:
            try:
                state = await self._apply(manifest, state)
            except WeightSyncError as exc:
                self._log.error("weights_version_rejected", version=manifest.version, target=target, error=str(exc))
                raise
        assert state is not None
        self._state = state
        self._log.info("weights_fetched", version=target, seconds=round(time.perf_counter() - started, 4))
        return state.tensors

    async def _read_manifest(self, version: int) -> Manifest:
        key = manifest_key(self.config.key_prefix, self.config.run, version)
        try:
            data = await self._retry.run("get", key, lambda: self.store.get(key))
        except KeyError:
            raise VersionUnavailable(f"version {version} of run {self.config.run!r} is not published") from None
        manifest = Manifest.from_json(data, where=key)
        if manifest.version != version or manifest.run != self.config.run:
            raise CorruptVersion(
                f"{key} describes run {manifest.run!r} version {manifest.version}: a version stored "
                "out of order or under the wrong key"
            )
        return manifest

    async def _plan(self, target: int) -> list[Manifest]:
        chain: list[Manifest] = []
        version: int | None = target
        held = self.version
        while version is not None:
            try:
                manifest = await self._read_manifest(version)
            except WeightSyncError as exc:
                self._log.error("weights_chain_broken", target=target, at=version, error=str(exc))
                raise
            chain.append(manifest)
            if manifest.base_version is not None and manifest.base_version == held:
                break
            version = manifest.base_version
        chain.reverse()
        return chain

    async def _apply(self, manifest: Manifest, base: WeightState | None) -> WeightState:
        _check_base(manifest, base)
        started = time.perf_counter()

        async def get(key: str) -> bytes:
            try:
                return await self._retry.run("get", key, lambda: self.store.get(key))
            except KeyError:
                raise VersionUnavailable(f"shard {key} of version {manifest.version} is missing") from None

        shards = await asyncio.gather(*(get(entry.key) for entry in manifest.shards))
        state = await asyncio.to_thread(decode_version, manifest, shards, base, executor=self._pool)
        self._log.info(
            "weights_version_applied", version=manifest.version, base_version=manifest.base_version,
            num_bytes=manifest.num_encoded_bytes, seconds=round(time.perf_counter() - started, 4),
        )  # fmt: skip
        return state
