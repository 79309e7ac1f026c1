"""The publisher: encodes and uploads one rank's part of every version in the background.

The training step's only share is :meth:`WeightPublisher.snapshot` (a copy of the tensors into
recycled buffers) and :meth:`WeightPublisher.submit` (queue it). Encoding runs in a pool of worker
threads at lowered priority (numpy, zstd and xxhash release the GIL, so they do not hold up the
step's Python code), uploads run as asyncio tasks, and the encoding of one version overlaps the
upload of the previous one. Transient storage errors are retried; a version that fails for good
breaks its chain, so the next version starts a new anchor. Versions older than the retention
window are deleted, except the anchor and deltas a retained version still needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Self

import structlog
import torch

from model.weight_sync._priority import lower_thread_priority
from model.weight_sync.codec import CodecConfig
from model.weight_sync.errors import PublishFailed, WeightSyncError
from model.weight_sync.manifest import parse_key, rank_prefix, run_prefix, validate_run
from model.weight_sync.store import BlobStoreLike, Retry, all_shards
from model.weight_sync.version import EncodedVersion, WeightState, encode_version

__all__ = ["PublishedVersion", "PublisherConfig", "WeightPublisher"]

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class PublisherConfig:
    """Publisher settings.

    Args:
        run: run name (part of every key).
        codec: how versions are encoded.
        key_prefix: first key segment of the weight tree.
        rank, world_size: this publisher's rank among the ranks that each publish their own part
            of every version (see ``sharding.rank_part``); readers assemble all parts.
        retain_versions: newest published versions kept; older ones are deleted unless a kept
            version's chain still needs them (its anchor and the deltas after it).
        max_pending: snapshots waiting for the encoder; beyond it the oldest waiting one is dropped
            (superseded) so the training step never waits. Deltas are always taken against the
            last encoded version, so the chain stays whole.
        max_attempts, backoff_base_s, backoff_max_s: retries of transient storage errors.
        upload_concurrency: shard uploads in flight.
        worker_nice: nice value (0-19) of the encoding threads: they yield CPU to the training step.
        worker_idle: also run them under SCHED_IDLE (only on CPUs nothing else wants; on a busy
            machine publishing may then lag, and versions get superseded).
    """

    run: str
    codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)
    key_prefix: str = "weights"
    rank: int = 0
    world_size: int = 1
    retain_versions: int = 16
    max_pending: int = 2
    max_attempts: int = 5
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0
    upload_concurrency: int = 4
    worker_nice: int = 10
    worker_idle: bool = False

    def __post_init__(self) -> None:
        validate_run(self.run)
        Retry(self.max_attempts, self.backoff_base_s, self.backoff_max_s)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must lie in [0, world_size={self.world_size}); world_size >= 1")
        if self.retain_versions < 1 or self.max_pending < 1 or self.upload_concurrency < 1:
            raise ValueError(
                f"retain_versions={self.retain_versions}, max_pending={self.max_pending}, "
                f"upload_concurrency={self.upload_concurrency} must all be >= 1"
            )
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice={self.worker_nice} must lie in [0, 19] (0 = the trainer's priority)")


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """One rank's part of a version, uploaded: its manifest key, sizes and timings."""

    version: int
    rank: int
    world_size: int
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


class _SnapshotBuffers:
    """Buffers of retired snapshots, reused so each step's copy does not fault in fresh memory."""

    def __init__(self) -> None:
        self._spare: list[dict[str, torch.Tensor]] = []
        self._owned: set[int] = set()  # ids of buffers this object made (only those are ever reused)

    def copy(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
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

    def retire(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep a no-longer-needed snapshot for reuse if copy() made every tensor in it."""
        if len(self._spare) < 2 and tensors and all(id(t) in self._owned for t in tensors.values()):
            self._spare.append(dict(tensors))
        else:
            self._owned.difference_update(id(t) for t in tensors.values())


class WeightPublisher:
    """Encodes and uploads versions in the background; ``submit`` never waits for either.

    Use ``async with WeightPublisher(store, config) as publisher:``; ``submit(version, state)``
    takes ownership of the tensors (pass a fresh copy: :meth:`snapshot`) and returns a future
    resolved once this rank's manifest is written. Leaving the context publishes everything pending.
    """

    def __init__(self, store: BlobStoreLike, config: PublisherConfig) -> None:
        self.store, self.config = store, config
        self._retry = Retry(config.max_attempts, config.backoff_base_s, config.backoff_max_s)
        self._pending: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._encoded: asyncio.Queue[tuple[_Job, EncodedVersion, float] | None] = asyncio.Queue(maxsize=1)
        self._futures: set[asyncio.Future[PublishedVersion]] = set()
        self._base: WeightState | None = None
        self._failed: set[int] = set()
        self._anchor_of: dict[int, int] = {}  # versions this publisher published -> their anchor
        self._known: list[int] | None = None  # versions in the store with this rank's files, once listed
        self._last_version: int | None = None
        self._buffers = _SnapshotBuffers()
        self._stack: contextlib.AsyncExitStack | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._driver: ThreadPoolExecutor | None = None
        self._status: Literal["new", "running", "closing", "closed"] = "new"
        self._log = log.bind(run=config.run, rank=config.rank, world_size=config.world_size)

    async def __aenter__(self) -> Self:
        if self._status != "new":
            raise RuntimeError(f"WeightPublisher is {self._status}; expected new (it is not reusable)")
        cfg = self.config
        init = functools.partial(lower_thread_priority, cfg.worker_nice, cfg.worker_idle)
        self._pool = ThreadPoolExecutor(cfg.codec.workers, "weights-encode", initializer=init)
        self._driver = ThreadPoolExecutor(1, "weights-encode-driver", initializer=init)
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self._pool.shutdown)
            stack.callback(self._driver.shutdown)
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

        The training step's whole share of publishing. Pass the result to :meth:`submit`; the
        publisher recycles it once it is no longer needed as a delta base.
        """
        return self._buffers.copy(tensors, dtype)

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
            self._buffers.retire(dropped.state)
        self._pending.append(_Job(version, state, future))
        self._wake.set()
        return future

    async def flush(self) -> None:
        """Wait until every submitted version is published or has failed."""
        await asyncio.gather(*list(self._futures), return_exceptions=True)

    async def _next_job(self) -> _Job | None:
        while not self._pending:
            if self._status == "closing":
                return None
            self._wake.clear()
            await self._wake.wait()
        return self._pending.popleft()

    async def _encode_loop(self) -> None:
        cfg = self.config
        while (job := await self._next_job()) is not None:
            base = self._base
            if base is not None and any(base.anchor_version <= v <= base.version for v in self._failed):
                base = None  # its chain has a version readers cannot get: start a new anchor
            started = time.perf_counter()
            encode = functools.partial(
                encode_version, job.state, base, run=cfg.run, version=job.version, config=cfg.codec,
                key_prefix=cfg.key_prefix, rank=cfg.rank, world_size=cfg.world_size, executor=self._pool,
            )  # fmt: skip
            try:
                encoded = await asyncio.get_running_loop().run_in_executor(self._driver, encode)
            except Exception as exc:
                self._log.exception("weights_encode_failed", version=job.version)
                job.future.set_exception(PublishFailed(f"encoding version {job.version} failed: {exc}"))
                continue
            if self._base is not None:
                self._buffers.retire(self._base.tensors)
            self._base = encoded.state
            await self._encoded.put((job, encoded, time.perf_counter() - started))
        await self._encoded.put(None)

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
                rank=manifest.rank,
                world_size=manifest.world_size,
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
        await all_shards(*(put(entry.key, blob) for entry, blob in shards))
        await put(encoded.manifest_key, encoded.manifest.to_json())  # last: this part now exists

    def _my_versions(self, keys: list[str]) -> list[int]:
        mine = (self.config.rank, self.config.world_size)
        parsed = [parse_key(key) for key in keys]
        return sorted({k.version for k in parsed if k is not None and (k.rank, k.world_size) == mine})

    async def _collect_garbage(self) -> None:
        cfg = self.config
        try:
            if self._known is None:  # first time: learn what earlier publishers of this rank left
                prefix = run_prefix(cfg.key_prefix, cfg.run)
                keys = await self._retry.run("list", prefix, lambda: self.store.list(prefix))
                self._known = self._my_versions(keys)
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
        """Delete this rank's part of ``version``: manifest first, so no reader sees missing shards."""
        cfg = self.config
        prefix = rank_prefix(cfg.key_prefix, cfg.run, version, cfg.rank, cfg.world_size)
        keys = await self._retry.run("list", prefix, lambda: self.store.list(prefix))
        for key in sorted(keys, key=lambda k: not k.endswith("/manifest.json")):
            await self._retry.run("delete", key, lambda key=key: self.store.delete(key))
        self._anchor_of.pop(version, None)
