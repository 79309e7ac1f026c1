"""A directory tree in the blob store, visible all at once: ``<prefix>/<file>`` and its manifest.

- put: every file first, then ``<prefix>/manifest.json`` (each file's size and sha256): the tree
  exists once its manifest does, so a writer killed mid-upload leaves no half tree;
- delete: the manifest first, then the files;
- get: into a destination folder through a temporary sibling renamed into place, each file checked
  against the manifest; a destination that already matches is used as it is. Each file is its own blob,
  so a reader that needs a few of them (a policy's tokenizer, not its weights) gets only those
  (``members``), checked all the same.

The trainer's checkpoints and the run's one-time builds (``runtime.build_once``) are such trees.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from runtime.blob._base import BlobNotFound, BlobStore

__all__ = ["MANIFEST", "CorruptTree", "delete_tree", "get_tree", "put_tree", "tree_exists"]

MANIFEST = "manifest.json"


class CorruptTree(ValueError):
    """A stored tree's manifest is missing or unreadable, or a file is missing or differs from it."""


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return path.stat().st_size, h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


async def put_tree(store: BlobStore, directory: Path, prefix: str) -> int:
    """Stores every file under ``directory`` as ``<prefix>/<relative path>``, then the manifest; returns bytes."""
    files: dict[str, Any] = {}
    for rel in await asyncio.to_thread(_files, directory):
        if rel == MANIFEST:
            raise ValueError(f"{directory} holds a file named {MANIFEST}, the name of the tree's manifest")
        size, sha = await asyncio.to_thread(_digest, directory / rel)
        with open(directory / rel, "rb") as fh:
            await store.put_stream(f"{prefix}/{rel}", fh)
        files[rel] = {"size": size, "sha256": sha}
    await store.put(f"{prefix}/{MANIFEST}", json.dumps({"files": files}).encode())
    return sum(f["size"] for f in files.values())


async def tree_exists(store: BlobStore, prefix: str) -> bool:
    return await store.exists(f"{prefix}/{MANIFEST}")


async def _manifest(store: BlobStore, prefix: str) -> dict[str, Any]:
    try:
        return dict(json.loads(await store.get(f"{prefix}/{MANIFEST}"))["files"])
    except BlobNotFound:
        raise CorruptTree(f"{prefix} has no manifest in {store.url}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptTree(f"the manifest of {prefix} in {store.url} is corrupt ({e!r})") from None


def _matches(directory: Path, files: dict[str, Any]) -> bool:
    if not directory.is_dir() or _files(directory) != sorted(files):
        return False
    return all(_digest(directory / rel) == (f["size"], f["sha256"]) for rel, f in files.items())


async def get_tree(store: BlobStore, prefix: str, destination: Path, members: Collection[str] | None = None) -> Path:
    """``destination``, holding the stored tree ``prefix`` (checked against its manifest).

    Args:
        members: only these files of the tree (relative paths; those it does not list are not in it, and
            not fetched): ``destination`` then holds them alone.

    Raises:
        CorruptTree: the manifest is missing or corrupt, or a file is missing or differs from it.
    """
    files = await _manifest(store, prefix)
    if members is not None:
        files = {rel: f for rel, f in files.items() if rel in members}
    if await asyncio.to_thread(_matches, destination, files):
        return destination
    tmp = destination.with_name(f".tmp-{destination.name}-{os.getpid()}")
    await asyncio.to_thread(shutil.rmtree, tmp, True)
    try:
        for rel, f in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(path, "wb") as fh:
                    async for chunk in store.get_stream(f"{prefix}/{rel}"):
                        await asyncio.to_thread(fh.write, chunk)
            except BlobNotFound:
                raise CorruptTree(f"{prefix} lacks {rel} in {store.url}") from None
            if await asyncio.to_thread(_digest, path) != (f["size"], f["sha256"]):
                raise CorruptTree(f"{prefix}/{rel} in {store.url} differs from its manifest")
        await asyncio.to_thread(shutil.rmtree, destination, True)
        os.replace(tmp, destination)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    return destination


async def delete_tree(store: BlobStore, prefix: str) -> None:
    """Deletes the tree: its manifest first (it stops existing), then every key under ``prefix/``."""
    await store.delete(f"{prefix}/{MANIFEST}")
    for key in await store.list(f"{prefix}/"):
        await store.delete(key)
