"""Async generation engine for rollouts: continuous batching, KV cache, router capture, in-flight swaps.

Many coroutines call `await engine.generate(prompt_ids, params)`; one background loop owned by the engine
batches them. Each iteration hands the loop's inbox (new requests, cancellations, weight updates) to
`EngineCore.step` running in the engine's own worker thread (`model.step_thread`, with
`EngineConfig.intra_op_threads` intra-op threads, by default chosen by the model's size), one step at a
time, so the event loop stays responsive while the model runs. Weight updates are applied between two
steps: the pause is the parameter copy. Each running sequence then follows the update's `KVPolicy` (recorded in its
`Generation.swaps`), and the core refuses to attend over KV of another version unless KEEP was chosen.

Lifecycle: CREATED --start()--> RUNNING --stop()--> STOPPED (idempotent; wrong-state calls raise
`EngineStateError`). stop() finishes the step in progress, then fails outstanding requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import enum
from collections.abc import Callable, Sequence

import structlog
import torch

from model._engine_core import EngineCore, Request
from model.checkpoint import checked_state
from model.errors import EngineError, EngineStateError
from model.generation import EngineConfig, FinishReason, Generation, KVPolicy, WeightSwap
from model.sampling import SamplingParams
from model.step_thread import auto_threads, step_executor
from model.transformer import MoETransformer

__all__ = [
    "EngineConfig",
    "EngineStats",
    "EngineStatus",
    "FinishReason",
    "Generation",
    "GenerationEngine",
    "KVPolicy",
    "SamplingParams",
    "WeightSwap",
]

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built (read between steps; approximate while one runs)."""

    num_waiting: int
    num_running: int
    num_steps: int
    num_generated_tokens: int
    num_prefill_tokens: int
    version: int


class EngineStatus(enum.StrEnum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclasses.dataclass(eq=False)
class _Update:
    state: dict[str, torch.Tensor]
    version: int
    policy: KVPolicy
    done: asyncio.Future[None]


class GenerationEngine:
    """Batched generation over one `MoETransformer` (see the module docstring)."""

    def __init__(
        self,
        model: MoETransformer,
        config: EngineConfig | None = None,
        *,
        version: int = 0,
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self._core = EngineCore(model.eval(), config or EngineConfig(), version, detokenize)
        self._status = EngineStatus.CREATED
        self._inbox: list[Request] = []
        self._cancelled: list[int] = []
        self._updates: list[_Update] = []
        self._futures: dict[int, asyncio.Future[Generation]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # the step thread, from start()
        self._stopping = False
        self._stepping = False  # a step runs in the worker thread
        self._stepped: asyncio.Event | None = None  # set (and replaced) at the end of every step
        self._newest_version = version  # newest version accepted by update_weights (maybe not yet applied)

    @property
    def status(self) -> EngineStatus:
        return self._status

    @property
    def version(self) -> int:
        """Weight version of the model (after any update already applied)."""
        return self._core.version

    def stats(self) -> EngineStats:
        core = self._core
        return EngineStats(
            num_waiting=len(core.waiting) + len(self._inbox),
            num_running=len(core.running),
            num_steps=core.num_steps,
            num_generated_tokens=core.num_generated_tokens,
            num_prefill_tokens=core.num_prefill_tokens,
            version=core.version,
        )

    @property
    def model(self) -> MoETransformer:
        return self._core.model

    def _require(self, status: EngineStatus, action: str) -> None:
        if self._status is not status:
            raise EngineStateError(f"cannot {action}: engine is {self._status.value}, expected {status.value}")

    async def start(self) -> None:
        """Start the background step loop."""
        self._require(EngineStatus.CREATED, "start")
        self._wake = asyncio.Event()
        self._stepped = asyncio.Event()
        threads = self._core.config.intra_op_threads
        self._executor = step_executor(auto_threads(self._core.model) if threads == "auto" else threads)
        self._task = asyncio.create_task(self._loop(), name="generation-engine")
        self._status = EngineStatus.RUNNING
        log.info("engine_started", version=self.version, max_batch_size=self._core.config.max_batch_size)

    async def stop(self) -> None:
        """Finish the step in progress, fail outstanding requests, stop the loop (idempotent)."""
        if self._status in (EngineStatus.CREATED, EngineStatus.STOPPED):
            self._status = EngineStatus.STOPPED
            return
        self._stopping = True
        assert self._wake is not None and self._task is not None
        self._wake.set()
        try:
            await self._task
        finally:
            self._fail_outstanding(EngineStateError("engine stopped before the request finished"))
            if self._status is not EngineStatus.FAILED:
                self._status = EngineStatus.STOPPED
            if self._executor is not None:
                self._executor.shutdown(wait=False)  # no step is left: the loop has ended
            if self._stepped is not None:
                self._stepped.set()  # a liveness check waiting for a step that will not come
            log.info("engine_stopped", status=self._status.value)

    async def check_alive(self, prompt_ids: Sequence[int]) -> None:
        """Liveness, as a health probe wants it: with work in hand, the end of the step in progress or the next
        (a wedged step never ends; a new request would wait behind every queued prefill, which on a large
        policy takes longer than any probe's bound); idle, one token of ``prompt_ids`` decoded now (the whole
        path, as a new request takes it).

        Raises:
            EngineError: the engine failed (a step raised), or decoded other than the one token asked.
            EngineStateError: the engine is not running.
        """
        self._require(EngineStatus.RUNNING, "check liveness")
        if self._stepping or self._inbox or self._core.has_work:
            assert self._stepped is not None
            await self._stepped.wait()
            if self._status is EngineStatus.FAILED:
                raise EngineError("the engine failed: its last step raised")
            self._require(EngineStatus.RUNNING, "check liveness")  # stopped while we waited
            return
        generation = await self.generate(prompt_ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        if len(generation.token_ids) != 1:
            raise EngineError(f"the engine decoded {len(generation.token_ids)} tokens for one asked")

    def _end_step(self) -> None:
        assert self._stepped is not None
        stepped, self._stepped = self._stepped, asyncio.Event()
        stepped.set()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Generation:
        """Generate one completion; batched with every other concurrent call."""
        self._require(EngineStatus.RUNNING, "generate")
        request = self._core.make_request(prompt_ids, params or SamplingParams())
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = future
        self._inbox.append(request)
        self._signal()
        try:
            return await future
        except asyncio.CancelledError:
            if self._futures.pop(request.request_id, None) is not None:
                self._cancelled.append(request.request_id)
                self._signal()
            raise

    async def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, kv_policy: KVPolicy = KVPolicy.RECOMPUTE
    ) -> None:
        """Swap in new weights (this model's or HF names) between two decode steps; returns once applied.

        Before start() the weights are copied at once.

        Raises:
            ValueError: `version` is not newer than every update already accepted (applied, queued or
                being applied), so a duplicate of a version is refused, never applied twice.
            CheckpointError: keys or shapes do not match the model.
        """
        if self._status not in (EngineStatus.CREATED, EngineStatus.RUNNING):
            raise EngineStateError(f"cannot update_weights: engine is {self._status.value}")
        if version <= self._newest_version:  # applied, queued, or being applied in the worker thread
            raise ValueError(
                f"weight version {version} is not newer than the engine's {self.version} "
                f"(newest accepted {self._newest_version}); an update is applied once"
            )
        state_dict = checked_state(self._core.model, state_dict)  # errors reach the caller, not the loop
        self._newest_version = version
        if self._status is EngineStatus.CREATED:
            self._core.apply_update(state_dict, version, KVPolicy(kv_policy))
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._updates.append(_Update(state_dict, version, KVPolicy(kv_policy), done))
        self._signal()
        await done

    def _signal(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _take_inputs(self) -> tuple[list[Request], list[int], list[_Update]]:
        taken = (self._inbox, self._cancelled, self._updates)
        self._inbox, self._cancelled, self._updates = [], [], []
        return taken

    def _step(
        self, requests: list[Request], cancelled: list[int], updates: list[_Update]
    ) -> list[tuple[int, Generation]]:
        """Runs in the worker thread: apply inputs in order, then one step."""
        core = self._core
        for request_id in cancelled:
            core.cancel(request_id)
        for update in updates:
            core.apply_update(update.state, update.version, update.policy)
        for request in requests:
            core.add(request)
        return core.step()

    async def _loop(self) -> None:
        assert self._wake is not None and self._executor is not None
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not (self._inbox or self._cancelled or self._updates or self._core.has_work):
                self._wake.clear()
                await self._wake.wait()
                continue
            requests, cancelled, updates = self._take_inputs()
            self._stepping = True
            try:
                run = contextvars.copy_context().run  # as asyncio.to_thread: the step logs with our context
                finished = await loop.run_in_executor(self._executor, run, self._step, requests, cancelled, updates)
            except Exception as exc:
                log.exception("engine_step_failed")
                self._status = EngineStatus.FAILED
                self._end_step()
                for update in updates:
                    if not update.done.done():
                        update.done.set_exception(EngineError(f"engine step failed: {exc!r}"))
                self._fail_outstanding(EngineError(f"engine step failed: {exc!r}"))
                return
            finally:
                self._stepping = False
            self._end_step()
            for update in updates:
                if not update.done.done():  # the caller may have stopped waiting
                    update.done.set_result(None)
            for request_id, generation in finished:
                future = self._futures.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(generation)

    def _fail_outstanding(self, error: Exception) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()
        for update in self._updates:
            if not update.done.done():
                update.done.set_exception(error)
        self._updates.clear()
