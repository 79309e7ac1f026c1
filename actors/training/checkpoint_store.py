"""The trainer's checkpoints in the run's blob store, so that a trainer on any machine resumes from them.

The learner saves a checkpoint as a local directory (``Learner.save``: weights, optimizer moments,
version and trained-group ledger, however its files are laid out, per-rank shards included). Here
such a directory becomes the stored tree ``checkpoints/<name>/`` (``runtime.blob.put_tree``: its
manifest written last, so a trainer killed mid-upload leaves no checkpoint half there) and comes back
into a local cache (``get_tree``, checked against the manifest; a cached copy that matches is used as
it is). The local directory is a cache: the store's newest checkpoint is the trainer's state.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from runtime.blob import MANIFEST, BlobStore, delete_tree, get_tree, put_tree

log = structlog.get_logger(__name__)

__all__ = ["CHECKPOINTS_PREFIX", "download_checkpoint", "prune_checkpoints", "stored_checkpoints",
           "upload_checkpoint"]

CHECKPOINTS_PREFIX = "checkpoints"


async def upload_checkpoint(store: BlobStore, directory: Path) -> str:
    """Stores the checkpoint ``directory`` as ``checkpoints/<its name>``; returns the name."""
    num_bytes = await put_tree(store, directory, f"{CHECKPOINTS_PREFIX}/{directory.name}")
    log.info("checkpoint_stored", name=directory.name, num_bytes=num_bytes)
    return directory.name


async def stored_checkpoints(store: BlobStore) -> list[str]:
    """The names of the complete checkpoints in the store (their manifest is there), oldest first."""
    keys = await store.list(f"{CHECKPOINTS_PREFIX}/")
    return sorted(k.split("/")[1] for k in keys if k.count("/") == 2 and k.endswith(f"/{MANIFEST}"))


async def download_checkpoint(store: BlobStore, name: str, cache_dir: Path) -> Path:
    """``<cache_dir>/<name>``: the stored checkpoint ``name``, checked against its manifest.

    Raises:
        CorruptTree: its manifest is missing or corrupt, or a file is missing or differs from it.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = await get_tree(store, f"{CHECKPOINTS_PREFIX}/{name}", cache_dir / name)
    log.info("checkpoint_fetched", name=name, directory=str(path))
    return path


async def prune_checkpoints(store: BlobStore, keep: int) -> list[str]:
    """Deletes all but the newest ``keep`` complete checkpoints, and what an upload that never finished
    (no manifest) left below the newest kept one; returns the names of the complete ones deleted."""
    names = await stored_checkpoints(store)
    doomed = names[:-keep] if keep > 0 else names
    for name in doomed:
        await delete_tree(store, f"{CHECKPOINTS_PREFIX}/{name}")
    kept = sorted(set(names) - set(doomed))
    if kept:
        leftovers = {k.split("/")[1] for k in await store.list(f"{CHECKPOINTS_PREFIX}/")} - set(kept)
        for name in sorted(n for n in leftovers if n < kept[0]):
            await delete_tree(store, f"{CHECKPOINTS_PREFIX}/{name}")
    return doomed
