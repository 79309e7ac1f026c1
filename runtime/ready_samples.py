"""Ready samples in the Ray object store, beside the durable copy in the blob store (the Ray backend only).

A producer (the grouping actor) writes a ready group's checkpoint to the blob store first (the source
of truth: resume and every fallback read it), then puts the same bytes into the Ray object store; the
consumer (the trainer) reads them by reference from there, and from the blob store when they are not
there (never put, evicted, or lost with a node). Ray spills objects to its nodes' disks under memory
pressure.

Ownership: an object belongs to the process that put it and dies with it, so each is put by a detached
named actor of the run (`_Holder`, on the head node), which keeps its reference: a grouping actor that
dies after its put takes nothing with it. (Ray 2.56 removed ``ray.put(..., _owner=)``, which would
save the hop through the holder: the bytes travel producer → holder → object store.) The holder keeps
at most ``max_entries`` references (the oldest go first: read from the blob store then); the consumer
releases what it has trained; the supervisor's Ray backend kills the holder when the run ends.

An actor process finds the cluster through ``RAY_ADDRESS``, which the Ray backend sets in its
environment (runtime.ray_backend); it connects to Ray on first use only, so kinds that never use the
store never pay for a Ray driver.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import sys
from typing import Any

import structlog

log = structlog.get_logger(__name__)

__all__ = ["HOLDER_NAME", "ReadySamples", "holder_namespace", "kill_holder"]

HOLDER_NAME = "ready-samples"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
MAX_ENTRIES = 4096  # ready groups kept by reference; a handful of batches is what a trainer ever waits on
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node
CALL_TIMEOUT_S = 30.0  # one call to the holder, or one fetch; past it the blob store answers
CONNECT_TIMEOUT_S = 60.0  # this process joining the cluster as a Ray driver (its first use of the store)


def holder_namespace(run_dir: str) -> str:
    """The Ray namespace of one run's holder: runs sharing a cluster share nothing."""
    return "run-" + hashlib.blake2b(str(run_dir).encode(), digest_size=6).hexdigest()


class _Holder:
    """The owner of a run's ready samples: keeps each key's object reference (wrapped in a list, so Ray
    passes the reference, not the value) until released or pushed out by newer ones."""

    def __init__(self, max_entries: int) -> None:
        self._refs: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self._max_entries = max_entries

    def keep(self, key: str, data: bytes) -> int:
        import ray

        self._refs[key] = [ray.put(data)]  # owned by this actor: it outlives the producer
        self._refs.move_to_end(key)
        while len(self._refs) > self._max_entries:
            self._refs.popitem(last=False)
        return len(self._refs)

    def find(self, keys: list[str]) -> dict[str, list[Any]]:
        return {k: self._refs[k] for k in keys if k in self._refs}

    def release(self, keys: list[str]) -> int:
        return sum(self._refs.pop(k, None) is not None for k in keys)


class ReadySamples:
    """A process's handle on its run's ready samples (connects to Ray on first use)."""

    def __init__(self, address: str, namespace: str, max_entries: int = MAX_ENTRIES) -> None:
        self.address = address
        self.namespace = namespace
        self.max_entries = max_entries
        self._holder: Any = None
        self._lock = asyncio.Lock()
        self.num_hits = 0  # reads the object store answered
        self.num_misses = 0  # reads left to the blob store

    @classmethod
    def from_environment(cls, run_dir: str) -> ReadySamples | None:
        """The store when this process was placed by the Ray backend (``RAY_ADDRESS`` set), else None."""
        address = os.environ.get(RAY_ADDRESS_ENV, "")
        return cls(address, holder_namespace(run_dir)) if address else None

    async def put(self, key: str, data: bytes) -> bool:
        """Puts ``data`` under ``key``, owned by the run's holder; False (said in an event) if it could not:
        the consumer reads the blob store then."""
        try:
            holder = await self._connected()
            await asyncio.wait_for(holder.keep.remote(key, data), CALL_TIMEOUT_S)
            return True
        except Exception as e:  # Ray raises many unrelated types; the durable copy stands either way
            log.warning("ready_sample_not_put", key=key, error=repr(e)[:300])
            return False

    async def get(self, key: str) -> bytes | None:
        """The bytes put under ``key``, or None when the store does not have them (read the blob store)."""
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The bytes put under each of ``keys`` (one call to the holder, the fetches together), None for
        those the store does not have (read them from the blob store)."""
        try:
            holder = await self._connected()
            found = await asyncio.wait_for(holder.find.remote(list(keys)), CALL_TIMEOUT_S)
            refs = [found[k][0] for k in keys if k in found]
            values = iter(await asyncio.wait_for(asyncio.gather(*refs), CALL_TIMEOUT_S))
            out = [next(values) if k in found else None for k in keys]
        except Exception as e:  # objects lost with their node, the holder gone, a timeout: the blob store answers
            log.warning("ready_samples_not_read", keys=keys[:8], error=repr(e)[:300])
            out = [None] * len(keys)
        self.num_hits += sum(v is not None for v in out)
        self.num_misses += sum(v is None for v in out)
        return out

    async def release(self, keys: list[str]) -> None:
        """Lets the store drop ``keys`` (trained): their memory and spill space come back."""
        if self._holder is None:
            return
        try:
            await asyncio.wait_for(self._holder.release.remote(list(keys)), CALL_TIMEOUT_S)
        except Exception as e:  # kept until pushed out by newer samples, or the run's end
            log.warning("ready_samples_not_released", num_keys=len(keys), error=repr(e)[:300])

    async def _connected(self) -> Any:
        async with self._lock:
            if self._holder is None:
                self._holder = await asyncio.wait_for(asyncio.to_thread(self._connect), CONNECT_TIMEOUT_S)
            return self._holder

    def _connect(self) -> Any:
        import ray
        import ray.cloudpickle

        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # a node needs no copy of the project
        holder = ray.remote(_Holder).options(  # on the head: the one node whose loss ends the cluster anyway
            name=HOLDER_NAME, namespace=self.namespace, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=0, resources={HEAD_RESOURCE: 0.001}).remote(self.max_entries)
        log.info("ready_samples_connected", address=self.address, namespace=self.namespace)
        return holder


def kill_holder(namespace: str) -> bool:
    """Ends a run's holder (and with it every object it owns); False when there is none. Ray connected."""
    import ray

    try:
        ray.kill(ray.get_actor(HOLDER_NAME, namespace=namespace))
    except ValueError:  # no such actor: nothing was ever put
        return False
    return True
