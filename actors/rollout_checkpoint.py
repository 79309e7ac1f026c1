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

import asyncio
import dataclasses
import re
import time
from dataclasses import dataclass

import structlog
import zstandard

from actors.agent.trajectory import Segment, Trajectory
from actors.records import RECORD_SCHEMA, RecordError, decode_record, encode_record
from runtime.blob import BlobError
from sandbox import Environment, LayerStore, SandboxLimits, Snapshot, export_snapshot_bytes, import_snapshot_bytes
from sandbox.errors import SandboxError

log = structlog.get_logger(__name__)

__all__ = [
    "NO_CHECKPOINT",
    "CapturedCheckpoint",
    "CheckpointWrite",
    "Resume",
    "RolloutCheckpoint",
    "RolloutCheckpoints",
    "checkpoint_key",
    "checkpoint_prefix",
    "encode_checkpoint",
    "num_policy_tokens",
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
    """What writing one checkpoint cost: stored bytes, seconds in all, and of those the seconds the episode
    waited for (the capture; the rest ran beside it)."""

    key: str
    num_bytes: int
    seconds: float
    blocking_s: float = 0.0


class CapturedCheckpoint:
    """A checkpoint taken (snapshot held, transcript copied) and not yet written; `write` once."""

    def __init__(self, checkpoints: RolloutCheckpoints, checkpoint: RolloutCheckpoint, snapshot: Snapshot,
                 capture_s: float) -> None:
        self.checkpoints, self.checkpoint, self.snapshot, self.capture_s = checkpoints, checkpoint, snapshot, capture_s

    async def write(self) -> CheckpointWrite | None:
        """Exports the snapshot and encodes the record (in a thread: neither touches the event loop's state),
        puts it and releases the snapshot. A failure costs only the saved work: it is said
        (`rollout_checkpoint_failed`) and None returned. ``seconds`` counts the capture too."""
        c = self.checkpoint
        started = time.perf_counter()
        try:
            data = await asyncio.to_thread(self._encode)
            key = checkpoint_key(c.sample_id, c.attempt, c.trajectory.num_turns)
            await self.checkpoints.blob.put(key, data)  # type: ignore[attr-defined]
        except (BlobError, OSError, SandboxError) as e:  # a workspace over the export's budgets included
            log.warning("rollout_checkpoint_failed", sample_id=c.sample_id, attempt=c.attempt,
                        num_turns=c.trajectory.num_turns, reason=repr(e))
            return None
        finally:
            self.snapshot.release()
        return CheckpointWrite(key, len(data), self.capture_s + time.perf_counter() - started, self.capture_s)

    def _encode(self) -> bytes:
        workspace = export_snapshot_bytes(self.snapshot)
        return encode_checkpoint(dataclasses.replace(self.checkpoint, workspace=workspace))


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
        elapsed = time.perf_counter() - started
        return CheckpointWrite(key, len(data), elapsed, elapsed)

    def capture(self, *, sample_id: str, prompt_id: str, attempt: int, seed: int, trajectory: Trajectory,
                env: Environment) -> CapturedCheckpoint | None:
        """What must be taken before the episode moves on, and only that (the episode waits for it): the
        environment's snapshot (~ the bytes changed since the last one) and a copy of the transcript. The
        rest, `CapturedCheckpoint.write`, can run while the episode goes on. None (and an event) when the
        workspace cannot be snapshotted (over its budgets: the policy's doing; the episode goes on)."""
        started = time.perf_counter()
        try:
            snapshot = env.snapshot()
        except (OSError, SandboxError) as e:
            log.warning("rollout_checkpoint_failed", sample_id=sample_id, attempt=attempt,
                        num_turns=trajectory.num_turns, reason=repr(e))
            return None
        copy = _transcript_copy(trajectory)
        return CapturedCheckpoint(self, RolloutCheckpoint(sample_id, prompt_id, attempt, seed, copy, b""), snapshot,
                                  time.perf_counter() - started)

    async def save(self, *, sample_id: str, prompt_id: str, attempt: int, seed: int, trajectory: Trajectory,
                   env: Environment) -> CheckpointWrite | None:
        """`capture` and `CapturedCheckpoint.write` in one: the checkpoint of the episode now, written."""
        captured = self.capture(sample_id=sample_id, prompt_id=prompt_id, attempt=attempt, seed=seed,
                                trajectory=trajectory, env=env)
        return await captured.write() if captured is not None else None

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
        if not _consistent(checkpoint.trajectory):
            return None, "corrupt: its transcript's per-token fields disagree in length"
        return checkpoint, ""


def _transcript_copy(traj: Trajectory) -> Trajectory:
    """``traj`` as it is now: later turns of the episode append to its current segment's lists and to its
    chain of segments (a segment's router choices array is replaced, never written in place, so it is shared)."""
    segments = [dataclasses.replace(
        seg, token_ids=list(seg.token_ids), loss_mask=list(seg.loss_mask),
        behaviour_logprobs=list(seg.behaviour_logprobs), logprob_temperatures=list(seg.logprob_temperatures),
        versions=list(seg.versions)) for seg in traj.segments]
    return dataclasses.replace(traj, segments=segments, tool_uses=list(traj.tool_uses))


def num_policy_tokens(traj: Trajectory) -> int:
    """The tokens of ``traj`` the policy sampled, over every segment (summaries included)."""
    return sum(sum(seg.loss_mask) for seg in traj.segments)


def _consistent(traj: Trajectory) -> bool:
    """The transcript has a segment, and every per-token field of each has one entry per token."""
    def whole(seg: Segment) -> bool:
        lengths = {len(seg.token_ids), len(seg.loss_mask), len(seg.behaviour_logprobs),
                   len(seg.logprob_temperatures), len(seg.versions)}
        return len(lengths) == 1 and (seg.topk_ids_TLK is None or seg.topk_ids_TLK.shape[0] == len(seg.token_ids))

    return bool(traj.segments) and all(whole(seg) for seg in traj.segments)
