"""How the trainer's ranks find each other: a rendezvous through the bus, one generation per group start.

The supervisor (or any backend) starts ``actors.trainer.ranks = N`` processes and tells each its rank and
N (``ASYNCRL_RANK`` / ``ASYNCRL_WORLD_SIZE``); nobody sets an address by hand. Rank 0 opens a
``torch.distributed`` TCP store on a free port of its host and writes, in the ``actors`` bucket under
``handover.trainer.rendezvous``, a new generation: ``{generation, host, port, world_size, formed: false}``.
The other ranks watch that key and join the newest generation that is not formed yet; once the group
has formed rank 0 marks it ``formed``. The group lives and dies as one:

- a rank that starts and finds only a formed generation (it is a restart: its old group lives on without
  it) marks that generation ``broken`` (compare-and-set on the revision it read) and waits for a new one;
- rank 0 watches the key and fails when its generation is marked broken: its process is restarted and
  opens the next generation, which the restarted rank joins;
- a rank whose peer died while they were in a collective gets gloo's error there and fails too.

The backend follows the trainer's device (``policy.device``): gloo on the CPU; on CUDA one group with two
backends, ``cpu:gloo,cuda:nccl``: NCCL carries what lives on the GPU (gradients, the experts' all-to-all),
gloo what lives on the CPU (plans, records and flags, whose object collectives torch runs on the CPU when
the group has a CPU backend). Each rank computes on its own GPU: ``cuda`` without an index is GPU
``rank mod count`` of those the process sees (one per rank on a host with several; under Ray each rank
sees only the one it was given), made the current device before the group forms, as NCCL requires.

So a rank killed with -9 fails the step in progress (its order is redelivered, not acknowledged), every
rank of the group restarts, and the new group resumes from the newest checkpoint; the trainer's ledger
of trained groups is in that checkpoint, so nothing is trained twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from datetime import timedelta

import msgpack
import structlog
import torch
import torch.distributed as dist

from actors.training.ranks import RankLayout
from runtime.bus import Bus
from runtime.errors import RevisionMismatch

log = structlog.get_logger(__name__)

__all__ = ["RENDEZVOUS_KEY", "GroupBroken", "TrainerGroup", "init_process_group", "process_group_backend",
           "rank_device"]

BUCKET = "actors"
RENDEZVOUS_KEY = "handover.trainer.rendezvous"  # beside the registry: a handover key, not an actor's entry


class GroupBroken(RuntimeError):
    """A rank of this group restarted: the group must restart together."""


@dataclasses.dataclass(frozen=True)
class Generation:
    generation: int
    host: str
    port: int
    world_size: int
    formed: bool = False
    broken: bool = False

    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> Generation:
        return cls(**msgpack.unpackb(raw, raw=False))


def _host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # a host without a resolvable name: only ranks on this host can join
        return "127.0.0.1"


def process_group_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend of a trainer computing on ``device``.

    Raises:
        ValueError: a device type with no backend here (only cpu and cuda are).
    """
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":  # CPU tensors (plans, objects, flags) still need gloo beside NCCL
        return "cpu:gloo,cuda:nccl"
    raise ValueError(f"the trainer's ranks have no process group backend for device {device}: use cpu or cuda")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device ``rank`` computes on: ``device``, with a CUDA device's index chosen per rank when it has none
    (GPU rank mod the number this process sees); an explicit ``cuda:N`` is kept."""
    if device.type != "cuda" or device.index is not None:
        return device
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"trainer rank {rank} is to compute on {device}, but this process sees no CUDA GPU")
    return torch.device("cuda", rank % count)


def init_process_group(store: dist.Store, layout: RankLayout, device: torch.device, timeout_s: float) -> None:
    """Joins this process to the group as ``layout.rank`` with the backend for ``device`` (blocks until
    all ``layout.world_size`` ranks have joined)."""
    backend = process_group_backend(device)
    if device.type == "cuda":  # NCCL binds a rank to the current device: this rank's own GPU, never GPU 0 for all
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=layout.rank, world_size=layout.world_size,
                            timeout=timedelta(seconds=timeout_s))
    log.info("trainer_process_group_initialised", rank=layout.rank, backend=backend, device=str(device))


class TrainerGroup:
    """This process's membership of the trainer's ``torch.distributed`` group (gloo, or gloo and NCCL on CUDA)."""

    def __init__(self, bus: Bus, layout: RankLayout, device: torch.device, timeout_s: float,
                 collective_timeout_s: float) -> None:
        self.bus = bus
        self.layout = layout
        self.device = device
        self.timeout_s = timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.generation: Generation | None = None
        self._store: dist.TCPStore | None = None  # rank 0 hosts it for the group's lifetime

    async def join(self) -> None:
        """Form (rank 0) or join (the others) the group; bounded by ``timeout_s``."""
        async with asyncio.timeout(self.timeout_s):
            if self.layout.rank == 0:
                await self._open()
            else:
                await self._join_newest()
        log.info("trainer_group_formed", rank=self.layout.rank, world_size=self.layout.world_size,
                 generation=self.generation.generation if self.generation else None)

    async def _open(self) -> None:
        previous = await self.bus.kv_get(BUCKET, RENDEZVOUS_KEY)
        number = Generation.decode(previous.value).generation + 1 if previous is not None else 1
        host, world = _host(), self.layout.world_size
        self._store = await asyncio.to_thread(dist.TCPStore, host, 0, world, True,
                                              timedelta(seconds=self.timeout_s), False)
        self.generation = Generation(number, host, self._store.port, world)
        await self.bus.kv_put(BUCKET, RENDEZVOUS_KEY, self.generation.encode())
        await asyncio.to_thread(self._init, self._store)
        self.generation = dataclasses.replace(self.generation, formed=True)
        await self.bus.kv_put(BUCKET, RENDEZVOUS_KEY, self.generation.encode())

    async def _join_newest(self) -> None:
        async for entry in self.bus.kv_watch(BUCKET, RENDEZVOUS_KEY):
            if entry is None or not entry.value:
                continue
            gen = Generation.decode(entry.value)
            if gen.world_size != self.layout.world_size:
                raise ValueError(f"the trainer group's rank 0 has {gen.world_size} ranks, this process "
                                 f"{self.layout.world_size}: actors.trainer.ranks changed under a live group")
            if gen.broken:
                continue  # its rank 0 will fail and open the next generation
            if gen.formed:  # formed without this process: a group it was part of before its restart
                try:
                    await self.bus.kv_cas(BUCKET, RENDEZVOUS_KEY, dataclasses.replace(gen, broken=True).encode(),
                                          entry.revision)
                    log.warning("trainer_group_marked_broken", rank=self.layout.rank, generation=gen.generation)
                except RevisionMismatch:
                    pass  # a newer generation came meanwhile: the watch brings it
                continue
            store = await asyncio.to_thread(dist.TCPStore, gen.host, gen.port, gen.world_size, False,
                                            timedelta(seconds=self.timeout_s))
            await asyncio.to_thread(self._init, store)
            self.generation = gen
            return

    def _init(self, store: dist.Store) -> None:
        # A peer that dies breaks every collective at once (gloo: "connection closed by peer"); the timeout
        # bounds only a peer that lives and never calls: ranks > 0 wait for rank 0's next plan this long.
        init_process_group(store, self.layout, self.device, self.collective_timeout_s)

    async def watch_broken(self) -> None:
        """Returns when this generation is marked broken (rank 0 then fails, and the group restarts)."""
        assert self.generation is not None
        async for entry in self.bus.kv_watch(BUCKET, RENDEZVOUS_KEY):
            if entry is None or not entry.value:
                continue
            gen = Generation.decode(entry.value)
            if gen.generation > self.generation.generation or (gen.generation == self.generation.generation
                                                               and gen.broken):
                raise GroupBroken(f"trainer group generation {self.generation.generation} is broken: a rank "
                                  f"restarted (rendezvous now at generation {gen.generation})")

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
