"""The trainer's checkpoints in the run's blob store, so that a trainer on any machine resumes from them.

The learner saves a checkpoint as a local directory (``Learner.save``: weights, optimizer moments,
version and trained-group ledger; however its files are laid out, per-rank shards included). This
module mirrors such a directory to ``checkpoints/<name>/<file>`` and back:

- upload: every file first, then ``checkpoints/<name>/manifest.json`` (each file's size and sha256):
  a checkpoint exists once its manifest does, so a trainer killed mid-upload leaves none half-there;
- prune: a checkpoint's manifest is deleted before its files;
- download: into ``<cache>/<name>`` through a temporary folder renamed into place, every file checked
  against the manifest; a cached copy that matches is used as it is.

The local directory is a cache: the store's newest checkpoint is the trainer's state.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import structlog

from runtime.blob import BlobNotFound, BlobStore

log = structlog.get_logger(__name__)

__all__ = ["CHECKPOINTS_PREFIX", "CorruptCheckpoint", "download_checkpoint", "prune_checkpoints",
           "stored_checkpoints", "upload_checkpoint"]

CHECKPOINTS_PREFIX = "checkpoints/"
MANIFEST = "manifest.json"


class CorruptCheckpoint(ValueError):
    """A stored checkpoint's file is missing or differs from its manifest."""


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return path.stat().st_size, h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


async def upload_checkpoint(store: BlobStore, directory: Path) -> str:
    """Mirrors the checkpoint ``directory`` to the store (its manifest last); returns its name."""
    name = directory.name
    files: dict[str, Any] = {}
    for rel in await asyncio.to_thread(_files, directory):
        size, sha = await asyncio.to_thread(_digest, directory / rel)
        with open(directory / rel, "rb") as fh:
            await store.put_stream(f"{CHECKPOINTS_PREFIX}{name}/{rel}", fh)
        files[rel] = {"size": size, "sha256": sha}
    await store.put(f"{CHECKPOINTS_PREFIX}{name}/{MANIFEST}", json.dumps({"files": files}).encode())
    log.info("checkpoint_stored", name=name, num_files=len(files), num_bytes=sum(f["size"] for f in files.values()))
    return name


async def stored_checkpoints(store: BlobStore) -> list[str]:
    """The names of the complete checkpoints in the store (their manifest is there), oldest first."""
    keys = await store.list(CHECKPOINTS_PREFIX)
    return sorted(k.split("/")[1] for k in keys if k.count("/") == 2 and k.endswith(f"/{MANIFEST}"))


async def _manifest(store: BlobStore, name: str) -> dict[str, Any]:
    try:
        data = json.loads(await store.get(f"{CHECKPOINTS_PREFIX}{name}/{MANIFEST}"))
        return dict(data["files"])
    except BlobNotFound:
        raise CorruptCheckpoint(f"checkpoint {name!r} has no manifest in {store.url}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {name!r}'s manifest in {store.url} is corrupt ({e!r})") from None


def _matches(directory: Path, files: dict[str, Any]) -> bool:
    if not directory.is_dir() or _files(directory) != sorted(files):
        return False
    return all(_digest(directory / rel) == (f["size"], f["sha256"]) for rel, f in files.items())


async def download_checkpoint(store: BlobStore, name: str, cache_dir: Path) -> Path:
    """``<cache_dir>/<name>``: the stored checkpoint ``name``, checked against its manifest.

    Raises:
        CorruptCheckpoint: the manifest is missing or corrupt, or a file is missing or differs from it.
    """
    files = await _manifest(store, name)
    final = cache_dir / name
    if await asyncio.to_thread(_matches, final, files):
        return final
    tmp = cache_dir / f".tmp-{name}-{os.getpid()}"
    await asyncio.to_thread(shutil.rmtree, tmp, True)
    try:
        for rel, f in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(path, "wb") as fh:
                    async for chunk in store.get_stream(f"{CHECKPOINTS_PREFIX}{name}/{rel}"):
                        await asyncio.to_thread(fh.write, chunk)
            except BlobNotFound:
                raise CorruptCheckpoint(f"checkpoint {name!r} lacks {rel} in {store.url}") from None
            if await asyncio.to_thread(_digest, path) != (f["size"], f["sha256"]):
                raise CorruptCheckpoint(f"checkpoint {name!r}'s {rel} in {store.url} differs from its manifest")
        await asyncio.to_thread(shutil.rmtree, final, True)
        os.replace(tmp, final)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    log.info("checkpoint_fetched", name=name, num_files=len(files), directory=str(final))
    return final


async def prune_checkpoints(store: BlobStore, keep: int) -> list[str]:
    """Deletes all but the newest ``keep`` complete checkpoints (manifest first); returns their names.
    Files of an upload that never finished (no manifest) older than the newest kept one go too."""
    names = await stored_checkpoints(store)
    doomed = names[:-keep] if keep > 0 else names
    for name in doomed:
        await store.delete(f"{CHECKPOINTS_PREFIX}{name}/{MANIFEST}")
    kept = set(names) - set(doomed)
    oldest_kept = min(kept, default="")
    for key in await store.list(CHECKPOINTS_PREFIX):
        name = key.split("/")[1]
        if name in doomed or (name not in kept and name < oldest_kept):
            await store.delete(key)
    return doomed
