"""The delta codec of one tensor: XOR (dense or sparse) or overwrite against a base, zstd, checksums.

A tensor is encoded against the same tensor of the base version as

- ``same``: bits identical to the base (nothing stored);
- ``xor_sparse``: a packed changed-element bitmap plus the XOR words of the changed elements;
- ``xor``: the XOR of all raw bits, as byte planes (all first bytes, then all second bytes...);
- ``raw``: the raw bits as byte planes (an anchor, a new tensor, or when smaller than the XOR).

Every payload is a zstd frame with its content checksum. Bits are hashed with xxh3-128 (the tensor
before encoding and its base), so decoding verifies it was given the right base and rebuilt the
right bits. All heavy work here (numpy ufuncs, zstd, xxhash) releases the GIL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import xxhash
import zstandard

from model.weight_sync.errors import BaseMismatch, CorruptVersion
from model.weight_sync.manifest import Encoding, TensorEntry

__all__ = [
    "CodecConfig",
    "EncodedTensor",
    "MiB",
    "bits",
    "checksum",
    "decode_tensor",
    "dtype_name",
    "encode_tensor",
    "from_bits",
    "parse_dtype",
]

MiB = 1024 * 1024
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 16  # elements per step of the sparse XOR loops: temporaries stay in cache


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


# -- bits, checksums, frames ---------------------------------------------------------------------


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as a flat integer array (shares memory when already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    view = _INT_VIEW.get(flat.element_size(), torch.uint8)
    return flat.view(view).numpy()


def from_bits(data: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(tuple(shape))


def checksum(buffer: np.ndarray | bytes | memoryview) -> str:
    return xxhash.xxh3_128(buffer).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
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


def _planes(words: np.ndarray) -> np.ndarray:
    """Byte planes (all first bytes, then all second bytes, ...): exponent bytes compress well."""
    if words.dtype.itemsize == 1:
        return words
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.dtype.itemsize).T)


def _unplanes(data: bytes, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(data, np.uint8).reshape(dtype.itemsize, -1)
    return planes.T.copy().view(dtype).reshape(-1)  # always a copy: writable, like every rebuilt tensor


def _sparse_xor(new: np.ndarray, base: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(packed changed-element bitmap, changed XOR words), or None once more than ``limit`` changed."""
    n = new.size
    scratch_x, scratch_m = np.empty(min(n, _CHUNK), new.dtype), np.empty(min(n, _CHUNK), bool)
    packed = np.empty((n + 7) // 8, np.uint8)
    values, count = [], 0
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        x, m = scratch_x[: stop - start], scratch_m[: stop - start]
        np.bitwise_xor(new[start:stop], base[start:stop], out=x)
        np.not_equal(x, 0, out=m)
        packed[start // 8 : (stop + 7) // 8] = np.packbits(m)
        values.append(np.compress(m, x))
        count += values[-1].size
        if count > limit:
            return None
    return packed, np.concatenate(values)


def _apply_sparse_xor(base: np.ndarray, packed: np.ndarray, values: np.ndarray, what: str) -> np.ndarray:
    n = base.size
    out, dense = np.empty_like(base), np.empty(min(n, _CHUNK), base.dtype)
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
        np.bitwise_xor(base[start:stop], d, out=out[start:stop])
    if offset != values.size:
        raise CorruptVersion(f"{what}: bitmap marks {offset} changes, {values.size} stored")
    return out


# -- one tensor ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EncodedTensor:
    """One tensor's frames and what a manifest records about it (the shard and offsets come later)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    frames: tuple[bytes, ...]
    num_raw_bytes: int
    num_changed: int
    checksum: str
    base_checksum: str | None


def encode_tensor(
    name: str, tensor: torch.Tensor, base: torch.Tensor | None, base_checksum: str | None, config: CodecConfig
) -> EncodedTensor:
    """Encode ``tensor`` against ``base`` (its bits hashing to ``base_checksum``), or whole if None."""
    new = bits(tensor)
    digest = checksum(new)
    compressor = zstandard.ZstdCompressor(level=config.zstd_level, threads=config.zstd_threads, write_checksum=True)
    meta = (name, dtype_name(tensor.dtype), tuple(tensor.shape))
    if base is None or base_checksum is None or base.dtype != tensor.dtype or base.shape != tensor.shape:
        frame = compressor.compress(_planes(new))
        return EncodedTensor(*meta, "raw", (frame,), new.nbytes, new.size, digest, None)
    if digest == base_checksum:
        return EncodedTensor(*meta, "same", (), new.nbytes, 0, digest, base_checksum)
    old = bits(base)
    sparse = _sparse_xor(new, old, int(config.sparse_max_fraction * new.size))
    if sparse is not None:
        packed, values = sparse
        frames = (compressor.compress(packed), compressor.compress(values))
        return EncodedTensor(*meta, "xor_sparse", frames, new.nbytes, values.size, digest, base_checksum)
    delta = np.bitwise_xor(new, old)
    num_changed = int(np.count_nonzero(delta))
    frames, encoding = (compressor.compress(_planes(delta)),), "xor"
    if num_changed >= config.overwrite_min_fraction * new.size:
        raw = compressor.compress(_planes(new))
        if len(raw) < len(frames[0]):
            frames, encoding = (raw,), "raw"
    return EncodedTensor(*meta, encoding, frames, new.nbytes, num_changed, digest, base_checksum)


def decode_tensor(entry: TensorEntry, shard: memoryview, base: torch.Tensor | None) -> np.ndarray:
    """Rebuild one tensor's bits from its frames in ``shard`` and (unless raw) its base tensor.

    Raises:
        BaseMismatch: the base is missing or its bits are not the ones the delta was encoded against.
        CorruptVersion: frames out of bounds or damaged, or the rebuilt bits fail the checksum.
    """
    what = f"tensor {entry.name!r}"
    dtype = parse_dtype(entry.dtype)
    numel = int(np.prod(entry.shape, dtype=np.int64))
    itemsize = torch.empty((), dtype=dtype).element_size()
    np_dtype = torch.empty(0, dtype=_INT_VIEW.get(itemsize, torch.uint8)).numpy().dtype
    count = numel * (1 if itemsize in _INT_VIEW else itemsize)
    frames = [shard[offset : offset + length] for offset, length in entry.frames]
    if any(len(frame) != length for frame, (_, length) in zip(frames, entry.frames, strict=True)):
        raise CorruptVersion(f"{what}: frames run past the end of shard {entry.shard}")
    old = None
    if entry.encoding != "raw":
        if base is None:
            raise BaseMismatch(f"{what} is encoded as {entry.encoding!r} but the base lacks it")
        old = bits(base)
        if old.size != count or checksum(old) != entry.base_checksum:
            raise BaseMismatch(f"{what}: base bits differ from the ones the delta was encoded against")
    nbytes = count * np_dtype.itemsize
    if entry.encoding == "raw":
        new = _unplanes(_decompress(frames[0], nbytes, what), np_dtype)
    elif entry.encoding == "same":
        new = old
    elif entry.encoding == "xor":
        new = np.bitwise_xor(old, _unplanes(_decompress(frames[0], nbytes, what), np_dtype))
    elif entry.encoding == "xor_sparse":
        packed = np.frombuffer(_decompress(frames[0], (count + 7) // 8, what), np.uint8)
        values = np.frombuffer(_decompress(frames[1], entry.num_changed * np_dtype.itemsize, what), np_dtype)
        new = _apply_sparse_xor(old, packed, values, what)
    else:
        raise CorruptVersion(f"{what}: unknown encoding {entry.encoding!r}")
    if checksum(new) != entry.checksum:
        raise CorruptVersion(f"{what}: rebuilt bits fail checksum {entry.checksum}")
    return new
