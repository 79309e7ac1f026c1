"""The subscriber: fetches versions, replays each rank's chain, verifies, and assembles the parts.

``fetch(v)`` finds the ranks that published ``v`` (an incomplete version is refused), then per rank
walks the chain back from ``v`` (manifests only) until it reaches the version it already holds or
an anchor, so a reader that fell behind an anchor jumps to it, then downloads, verifies and applies
each step. Any failure (missing, incomplete, corrupt, truncated or out-of-order version) raises
before anything is applied; the held state stays the last good version, and a later fetch past the
next anchor recovers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import structlog
import torch

from model.weight_sync.errors import CorruptVersion, IncompleteVersion, VersionUnavailable, WeightSyncError
from model.weight_sync.manifest import (
    Manifest,
    RankKey,
    complete_world_sizes,
    manifest_key,
    parse_key,
    run_prefix,
    validate_run,
    version_prefix,
)
from model.weight_sync.sharding import assemble
from model.weight_sync.store import BlobStoreLike, Retry, all_shards
from model.weight_sync.version import WeightState, check_base, decode_version

__all__ = ["SubscriberConfig", "WeightSubscriber"]

log = structlog.get_logger(__name__)


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
        validate_run(self.run)
        Retry(self.max_attempts, self.backoff_base_s, self.backoff_max_s)
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1")


class WeightSubscriber:
    """Fetches versions and rebuilds them bit for bit, holding the last good one as its base."""

    def __init__(self, store: BlobStoreLike, config: SubscriberConfig) -> None:
        self.store, self.config = store, config
        self._retry = Retry(config.max_attempts, config.backoff_base_s, config.backoff_max_s)
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="weights-decode")
        self._parts: tuple[WeightState, ...] = ()  # held version, one state per rank
        self._tensors: dict[str, torch.Tensor] | None = None  # the parts assembled
        self._fetching = asyncio.Lock()  # one fetch at a time: each continues from the held state
        self._log = log.bind(run=config.run)

    @property
    def version(self) -> int | None:
        return self._parts[0].version if self._parts else None

    @property
    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The held version's tensors, all ranks' parts assembled (read-only), or None."""
        return self._tensors

    @property
    def parts(self) -> tuple[WeightState, ...]:
        """The held version's parts, index = publishing rank."""
        return self._parts

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def versions(self) -> list[int]:
        """Complete versions (every rank's manifest exists), oldest first."""
        prefix = run_prefix(self.config.key_prefix, self.config.run)
        keys = await self._retry.run("list", prefix, lambda: self.store.list(prefix))
        by_version: dict[int, list[RankKey]] = {}
        for parsed in filter(None, map(parse_key, keys)):
            by_version.setdefault(parsed.version, []).append(parsed)
        return sorted(v for v, ks in by_version.items() if _complete(complete_world_sizes(ks)))

    async def latest_version(self) -> int | None:
        published = await self.versions()
        return published[-1] if published else None

    async def fetch(self, target: int) -> dict[str, torch.Tensor]:
        """Rebuild ``target`` and make it the held state; returns its tensors (read-only).

        Raises:
            VersionUnavailable: ``target`` or a version its chain needs is missing
                (IncompleteVersion: some ranks' parts of ``target`` are missing).
            CorruptVersion: a manifest or shard on the chain failed validation.
            BaseMismatch: the chain does not continue from the state it starts from.
        """
        async with self._fetching:
            if self._tensors is not None and self.version == target:
                return self._tensors
            started = time.perf_counter()
            world_size = await self._world_size(target)
            held = self._parts if len(self._parts) == world_size else (None,) * world_size
            parts = []
            for rank in range(world_size):  # all parts rebuilt before any is kept: all or nothing
                parts.append(await self._fetch_part(target, rank, world_size, held[rank]))
            tensors = assemble([part.tensors for part in parts], version=target)
            self._parts, self._tensors = tuple(parts), tensors
            self._log.info("weights_fetched", version=target, world_size=world_size,
                           seconds=round(time.perf_counter() - started, 4))  # fmt: skip
            return tensors

    async def _world_size(self, target: int) -> int:
        """The world size of ``target``'s complete set of rank manifests."""
        prefix = version_prefix(self.config.key_prefix, self.config.run, target)
        keys = await self._retry.run("list", prefix, lambda: self.store.list(prefix))
        ranks = complete_world_sizes(filter(None, map(parse_key, keys)))
        complete = _complete(ranks)
        if len(complete) == 1:
            return complete[0]
        if len(complete) > 1:
            raise CorruptVersion(f"version {target} is complete for several world sizes {complete}")
        if not ranks:
            self._log.error("weights_chain_broken", target=target, at=target, error="not published")
            raise VersionUnavailable(f"version {target} of run {self.config.run!r} is not published")
        missing = {w: sorted(set(range(w)) - got) for w, got in ranks.items()}
        self._log.error("weights_version_incomplete", target=target, missing_ranks=missing)
        raise IncompleteVersion(f"version {target} of run {self.config.run!r} lacks the parts of ranks {missing}")

    async def _fetch_part(self, target: int, rank: int, world_size: int, held: WeightState | None) -> WeightState:
        chain = await self._plan(target, rank, world_size, held)
        state = held if not chain[0].is_anchor else None
        self._log.info(
            "weights_fetch_planned", target=target, rank=rank, held=None if held is None else held.version,
            start=chain[0].version, from_anchor=state is None, num_steps=len(chain),
        )  # fmt: skip
        for manifest in chain:
            try:
                state = await self._apply(manifest, state)
            except WeightSyncError as exc:
                self._log.error("weights_version_rejected", version=manifest.version, rank=rank, target=target,
                                error=str(exc))  # fmt: skip
                raise
        assert state is not None
        return state

    async def _read_manifest(self, version: int, rank: int, world_size: int) -> Manifest:
        key = manifest_key(self.config.key_prefix, self.config.run, version, rank, world_size)
        try:
            data = await self._retry.run("get", key, lambda: self.store.get(key))
        except KeyError:
            raise VersionUnavailable(
                f"version {version} (rank {rank} of {world_size}) of run {self.config.run!r} is not published"
            ) from None
        manifest = Manifest.from_json(data, where=key)
        found = (manifest.run, manifest.version, manifest.rank, manifest.world_size)
        if found != (self.config.run, version, rank, world_size):
            raise CorruptVersion(
                f"{key} describes run {manifest.run!r} version {manifest.version} rank {manifest.rank} of "
                f"{manifest.world_size}: a version stored out of order or under the wrong key"
            )
        return manifest

    async def _plan(self, target: int, rank: int, world_size: int, held: WeightState | None) -> list[Manifest]:
        chain: list[Manifest] = []
        version: int | None = target
        while version is not None:
            try:
                manifest = await self._read_manifest(version, rank, world_size)
            except WeightSyncError as exc:
                self._log.error("weights_chain_broken", target=target, rank=rank, at=version, error=str(exc))
                raise
            chain.append(manifest)
            if held is not None and manifest.base_version == held.version:
                break
            version = manifest.base_version
        chain.reverse()
        return chain

    async def _apply(self, manifest: Manifest, base: WeightState | None) -> WeightState:
        check_base(manifest, base)
        started = time.perf_counter()

        async def get(key: str) -> bytes:
            try:
                return await self._retry.run("get", key, lambda: self.store.get(key))
            except KeyError:
                raise VersionUnavailable(f"shard {key} of version {manifest.version} is missing") from None

        shards = await all_shards(*(get(entry.key) for entry in manifest.shards))
        state = await asyncio.to_thread(decode_version, manifest, shards, base, executor=self._pool)
        self._log.info(
            "weights_version_applied", version=manifest.version, rank=manifest.rank,
            base_version=manifest.base_version, num_bytes=manifest.num_encoded_bytes,
            seconds=round(time.perf_counter() - started, 4),
        )  # fmt: skip
        return state


def _complete(ranks: dict[int, set[int]]) -> list[int]:
    """World sizes whose every rank's manifest is present."""
    return sorted(w for w, got in ranks.items() if got == set(range(w)))
