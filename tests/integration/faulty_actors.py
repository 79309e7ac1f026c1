"""Real actors with one injected fault each, for the fault tests (entries like ``tests.integration.faulty_actors:X``).

Each fault fires in the first process of its kind in a run only (a marker file in the run directory
says it fired), so the process the supervisor starts in its place shows the recovery.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import structlog

from actors.messages import WeightsPublished
from actors.stages.evaluator import EvaluatorActor
from actors.stages.rollout import RolloutActor
from actors.stages.trainer import TrainerActor
from runtime.actor import Delivery
from runtime.blob import BlobUnavailable, StorageFull

log = structlog.get_logger(__name__)


def _first_time(run_dir: Any, fault: str) -> bool:
    marker = Path(run_dir) / f"fault-{fault}"
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


class EngineFailingRolloutActor(RolloutActor):
    """The real rollout actor whose engine's first decode step raises: the engine is FAILED for good."""

    async def setup(self) -> None:
        await super().setup()
        if _first_time(self.ctx.run_dir, "engine"):
            def broken_forward(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected fault: the device fell off the bus")

            self.engine.model.forward = broken_forward  # type: ignore[method-assign]


# The points of the trainer's sequence for one version, and the version at which its process is killed at each;
# the last version (6) again between its checkpoint and its upload: the step budget is then reached, and only the
# restarted trainer's republishing lets the evaluator see that version and end the run.
TRAINER_KILLS = {1: "after_step", 2: "after_checkpoint", 3: "after_upload", 4: "after_announce", 5: "after_done",
                 6: "after_checkpoint"}


def _kill_self(run_dir: Any, fault: str) -> None:
    if _first_time(run_dir, fault):
        os.kill(os.getpid(), signal.SIGKILL)


class KilledTrainerActor(TrainerActor):
    """The real trainer, SIGKILLed once at each point of step -> checkpoint -> upload -> announce -> TrainDone
    (`TRAINER_KILLS`: the point, by the version being made)."""

    # the test stands in for the reconciler and answers no "still wanted?": a redelivered order waits this long
    # unasked, not the 30 s a real reconciler's absence is given (6 kills, 3 minutes of the test's time)
    still_wanted_patience_s = 3.0

    async def setup(self) -> None:
        await super().setup()
        step, save = self.learner.step, self.learner.save

        def killed_after_step(*args: Any, **kwargs: Any) -> Any:
            metrics = step(*args, **kwargs)
            self._maybe_killed("after_step", self.learner.version)
            return metrics

        def killed_after_checkpoint(*args: Any, **kwargs: Any) -> Any:
            path = save(*args, **kwargs)
            self._maybe_killed("after_checkpoint", self.learner.version)
            return path

        self.learner.step = killed_after_step  # type: ignore[method-assign]
        self.learner.save = killed_after_checkpoint  # type: ignore[method-assign]

    def _maybe_killed(self, point: str, version: int) -> None:
        if TRAINER_KILLS.get(version) == point:
            _kill_self(self.ctx.run_dir, f"trainer-{point}-v{version}")

    async def _announce(self, msg: WeightsPublished) -> None:
        self._maybe_killed("after_upload", msg.version)
        await super()._announce(msg)
        self._maybe_killed("after_announce", msg.version)

    async def handle(self, msg: Any, delivery: Delivery) -> None:
        await super().handle(msg, delivery)  # TrainDone is out; the order is not acked yet
        self._maybe_killed("after_done", self.learner.version)


EVALUATOR_KILLED_AT = 2


class KilledEvaluatorActor(EvaluatorActor):
    """The real evaluator, SIGKILLed once in the middle of evaluating version `EVALUATOR_KILLED_AT`, and once
    between writing the last version's row and asking the supervisor to finish the run."""

    async def _evaluate(self, version: int) -> None:
        if version == EVALUATOR_KILLED_AT:
            _kill_self(self.ctx.run_dir, "evaluator")
        await super()._evaluate(version)

    async def _finish_if_last_evaluated(self) -> float | None:
        last = self.last_version
        if last is not None and last in self.evaluated:
            _kill_self(self.ctx.run_dir, "evaluator-finish")
        return await super()._finish_if_last_evaluated()


class _WeightsPutsFail:
    """A blob store whose writes under ``weights/`` fail (a full disk, a revoked bucket); the rest passes through."""

    def __init__(self, store: Any) -> None:
        self._store = store

    async def put(self, key: str, data: Any) -> None:
        if key.startswith("weights/"):
            raise OSError(28, f"injected fault: no space left on device writing {key!r}")
        await self._store.put(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class PublishFailingTrainerActor(TrainerActor):
    """The real trainer whose first process cannot write weights: its publish keeps failing."""

    async def setup(self) -> None:
        if _first_time(self.ctx.run_dir, "publish"):
            self.ctx.blob = _WeightsPutsFail(self.ctx.blob)
        await super().setup()


# A write after the step that fails, by the version the step made: the store full past its bound (what the
# file store raises then), or unavailable (what the S3 store raises once its retries are spent), at each
# point of step -> row -> checkpoint -> weights -> metrics.
FAILED_WRITES = {1: ("checkpoints/", StorageFull), 2: ("trainer/pending-train-row", BlobUnavailable),
                 3: ("metrics/train/", BlobUnavailable)}
# With trainer.checkpoint_every = 2: version 3's metrics (after a step counted in full, the stored checkpoint
# the version before it), version 4's row (the stored checkpoint two versions back, version 3 acknowledged).
SPARSE_FAILED_WRITES = {3: ("metrics/train/", BlobUnavailable), 4: ("trainer/pending-train-row", BlobUnavailable)}


class _WritesFailAfterStep:
    """The trainer's store, one write failing once at each point of the trainer's ``failed_writes``."""

    def __init__(self, trainer: TrainerActor) -> None:
        self._trainer, self._store = trainer, trainer.ctx.blob

    def _fail(self, key: str) -> None:
        learner = getattr(self._trainer, "learner", None)  # None while it starts
        version = learner.version if learner is not None else -1
        prefix, error = self._trainer.failed_writes.get(version, ("", None))
        if error is not None and key.startswith(prefix) and _first_time(self._trainer.ctx.run_dir, f"write-v{version}"):
            raise error(f"injected fault: writing {key!r} after the step to version {version} failed")

    async def put(self, key: str, data: Any) -> None:
        self._fail(key)
        await self._store.put(key, data)

    async def put_stream(self, key: str, source: Any) -> int:
        self._fail(key)
        return await self._store.put_stream(key, source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class WriteFailingTrainerActor(TrainerActor):
    """The real trainer whose store fails one write after the step at each point of ``failed_writes``; it logs
    its counters around each step (``trainer_counters``), so a test sees what a rolled-back step left counted."""

    still_wanted_patience_s = 1.0  # the test plays the reconciler and answers no still-wanted question
    failed_writes = FAILED_WRITES

    async def setup(self) -> None:
        self.ctx.blob = _WritesFailAfterStep(self)  # type: ignore[assignment]
        await super().setup()

    async def _train_plan(self, *args: Any) -> dict[str, str]:
        version, num_samples, busy_s = self.learner.version, self.num_samples, self.busy_s
        failed = True
        try:
            dropped = await super()._train_plan(*args)
            failed = False
            return dropped
        finally:
            log.info("trainer_counters", version_before=version, version=self.learner.version, failed=failed,
                     num_samples_before=num_samples, num_samples=self.num_samples, busy_s_before=busy_s,
                     busy_s=self.busy_s)


class SparseWriteFailingTrainerActor(WriteFailingTrainerActor):
    """The same with writes failing at `SPARSE_FAILED_WRITES`, for a run with trainer.checkpoint_every = 2."""

    failed_writes = SPARSE_FAILED_WRITES
