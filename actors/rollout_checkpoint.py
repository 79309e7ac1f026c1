"""Rollout checkpoints: a rollout interrupted by any failure resumes where it was instead of starting over.

After each turn that continues an episode, the rollout writes one blob::

    samples/<sample>/a<attempt>/checkpoints/t<turns>     RolloutCheckpoint (zstd msgpack, actors.records)

holding the transcript so far (tokens, loss mask, behaviour log-probs and their temperatures, per-token
policy versions, router choices, counters: the `Trajectory` as it stands), the sampling seed of the
attempt that started the episode, and the environment's snapshot (the sandbox's export, a zstd tar of
the workspace). One blob per checkpoint, so a checkpoint is whole or absent (the stores write
atomically); under the sample's prefix, so the blob collector (actors.blob_collector) deletes them
with the sample's other blobs once its group was trained or dropped.

A re-issued attempt (its actor killed, its node lost, its reconciler resumed, or a redelivery of the
same attempt) asks `RolloutCheckpoints.newest` for the newest checkpoint of the sample, of any earlier
attempt or its own, whose tokens are still within the staleness bound (the oldest token's version
at most ``eta`` versions below the order's version floor), and continues the episode from it with
that seed, in an environment rebuilt from its snapshot: with the same seed and policy versions the
finished episode is token for token the one an uninterrupted attempt would have produced
(actors.agent.episode's ``start``). A checkpoint that is missing, corrupt, of another sample or past
the bound is skipped with an event naming why, and the next older one is tried; with none left the
attempt starts over, and says why (`rollout_started_over`). Nothing is lost either way: a checkpoint
only saves work.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import structlog
import zstandard

from actors.agent.episode import Trajectory
from actors.records import RECORD_SCHEMA, RecordError, decode_record, encode_record
from runtime.blob import BlobError
from sandbox import Environment, LayerStore, SandboxLimits, export_snapshot_bytes, import_snapshot_bytes
from sandbox.errors import SandboxError

log = structlog.get_logger(__name__)

__all__ = [
    "NO_CHECKPOINT",
    "CheckpointWrite",
    "Resume",
    "RolloutCheckpoint",
    "RolloutCheckpoints",
    "checkpoint_key",
    "checkpoint_prefix",
    "encode_checkpoint",
]

NO_CHECKPOINT = "no checkpoint"
_KEY = re.compile(r"^samples/(?P<sample>[^/]+)/a(?P<attempt>\d+)/checkpoints/t(?P<turns>\d+)$")


@dataclass(frozen=True)
class RolloutCheckpoint:
    """One episode after ``trajectory.num_turns`` turns, and its environment then.

    Attributes:
        sample_id, prompt_id: the sample and its task.
        attempt: the attempt that wrote it.
        seed: the sampling seed the episode was started with (a resumed attempt keeps it).
        trajectory: the transcript so far.
        workspace: the environment's snapshot export (``sandbox.export_snapshot_bytes``).
    """

    sample_id: str
    prompt_id: str
    attempt: int
    seed: int
    trajectory: Trajectory
    workspace: bytes
    schema: int = RECORD_SCHEMA


def checkpoint_prefix(sample_id: str) -> str:
    return f"samples/{sample_id}/"


def checkpoint_key(sample_id: str, attempt: int, num_turns: int) -> str:
    return f"{checkpoint_prefix(sample_id)}a{attempt}/checkpoints/t{num_turns:05d}"


def encode_checkpoint(checkpoint: RolloutCheckpoint) -> bytes:
    """The stored form (zstd level 1: a checkpoint is written every turn and mostly never read)."""
    return zstandard.ZstdCompressor(level=1).compress(encode_record(checkpoint))


@dataclass(frozen=True)
class CheckpointWrite:
    """What writing one checkpoint cost: stored bytes and seconds (encode + put)."""

    key: str
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class Resume:
    """Where a rollout attempt starts: a checkpoint (and its key), or over, with the reason."""

    checkpoint: RolloutCheckpoint | None
    key: str = ""
    reason: str = ""

    @property
    def num_turns(self) -> int:
        return self.checkpoint.trajectory.num_turns if self.checkpoint is not None else 0


class RolloutCheckpoints:
    """Writes a rollout's checkpoints and finds the one a re-issued attempt resumes from (see the module)."""

    def __init__(self, blob: object) -> None:
        self.blob = blob

    async def write(self, checkpoint: RolloutCheckpoint) -> CheckpointWrite:
        """Encodes ``checkpoint`` at once (before anything awaits: the episode may move on after) and puts it."""
        started = time.perf_counter()
        key = checkpoint_key(checkpoint.sample_id, checkpoint.attempt, checkpoint.trajectory.num_turns)
        data = encode_checkpoint(checkpoint)
        await self.blob.put(key, data)  # type: ignore[attr-defined]
        return CheckpointWrite(key, len(data), time.perf_counter() - started)

    async def save(self, *, sample_id: str, prompt_id: str, attempt: int, seed: int, trajectory: Trajectory,
                   env: Environment) -> CheckpointWrite | None:
        """Writes the checkpoint of the episode now: ``env``'s snapshot, exported, and the transcript. A
        failure costs only the saved work: it is said (`rollout_checkpoint_failed`) and None returned. The
        cost measured is the snapshot and export, the encoding and the store's put."""
        started = time.perf_counter()
        try:
            snapshot = env.snapshot()
            try:
                workspace = export_snapshot_bytes(snapshot)
            finally:
                snapshot.release()
            written = await self.write(RolloutCheckpoint(sample_id, prompt_id, attempt, seed, trajectory, workspace))
        except (BlobError, OSError, SandboxError) as e:  # a workspace over its budgets included
            log.warning("rollout_checkpoint_failed", sample_id=sample_id, attempt=attempt,
                        num_turns=trajectory.num_turns, reason=repr(e))
            return None
        return dataclasses.replace(written, seconds=time.perf_counter() - started)

    @staticmethod
    def rebuild(store: LayerStore, checkpoint: RolloutCheckpoint, limits: SandboxLimits | None) -> Environment:
        """The checkpoint's environment, rebuilt from its snapshot (on any host).

        Raises:
            SandboxError: the snapshot cannot be imported (corrupt, over the import budgets), or the
                environment cannot start.
        """
        with import_snapshot_bytes(store, checkpoint.workspace) as snapshot:
            return Environment.fork(snapshot, limits)

    async def newest(self, sample_id: str, prompt_id: str, attempt: int, *, version_floor: int, eta: int) -> Resume:
        """The newest usable checkpoint of ``sample_id`` for ``attempt`` (at most that attempt's own), else
        why there is none. Tries the candidates newest first (most turns, then latest attempt)."""
        candidates = []
        for key in await self.blob.list(checkpoint_prefix(sample_id)):  # type: ignore[attr-defined]
            m = _KEY.match(key)
            if m and m["sample"] == sample_id and int(m["attempt"]) <= attempt:
                candidates.append((int(m["turns"]), int(m["attempt"]), key))
        if not candidates:
            return Resume(None, reason=NO_CHECKPOINT)
        skipped: list[str] = []
        for _turns, _attempt, key in sorted(candidates, reverse=True):
            checkpoint, why = await self._read(key, sample_id, prompt_id)
            if checkpoint is not None:
                lag = version_floor - checkpoint.trajectory.min_version
                if lag <= eta:
                    return Resume(checkpoint, key)
                why = f"its oldest token is {lag} versions below the floor {version_floor} (eta {eta})"
            log.warning("rollout_checkpoint_skipped", sample_id=sample_id, key=key, reason=why)
            skipped.append(f"{key.rsplit('/', 3)[-3]}/{key.rsplit('/', 1)[-1]}: {why}")
        return Resume(None, reason=f"no usable checkpoint of {len(candidates)}: " + "; ".join(skipped[:3]))

    async def _read(self, key: str, sample_id: str, prompt_id: str) -> tuple[RolloutCheckpoint | None, str]:
        try:
            raw = await self.blob.get(key)  # type: ignore[attr-defined]
        except KeyError:
            return None, "missing (deleted after it was listed)"
        try:
            checkpoint = decode_record(zstandard.ZstdDecompressor().decompress(raw), RolloutCheckpoint, key)
        except (zstandard.ZstdError, RecordError) as e:
            return None, f"corrupt: {e}"
        if checkpoint.sample_id != sample_id or checkpoint.prompt_id != prompt_id:
            return None, f"of sample {checkpoint.sample_id!r} / prompt {checkpoint.prompt_id!r}"
        traj = checkpoint.trajectory
        lengths = {len(traj.token_ids), len(traj.loss_mask), len(traj.behaviour_logprobs),
                   len(traj.logprob_temperatures), len(traj.versions)}
        if len(lengths) != 1 or (traj.topk_ids_TLK is not None and traj.topk_ids_TLK.shape[0] != len(traj.token_ids)):
            return None, "corrupt: its transcript's per-token fields disagree in length"
        return checkpoint, ""

