"""Following a run's weights: ``weights.<run>`` signals -> fetch through the delta chain -> engine swap.

The rollout actors and the evaluator both hold a generation engine that must track the trainer's
published versions. A :class:`WeightsFollower` subscribes to the signal, remembers the newest
version announced, and loads it into the engine: the fetch and rebuild run in the background
(``model.weight_sync``), the engine swaps between two decode steps. Loads are serialised, and the
engine refuses a version it already has, so a version is applied once. A version that cannot be
fetched (corrupt, missing, incomplete) is logged and skipped; the next announcement recovers.
Waiting for one version (`reach`) is bounded: it ends in `WeightsUnavailable` naming the version.

An announcement is believed only for a version the store holds: its key must be the manifest of that
version of this run, and the manifest there must say so. Anything else (another run, a version never
published, one far ahead of the trainer) is rejected at once with a reason and counted, never waited
for: a forged announcement cannot make the follower chase weights that do not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from actors.messages import WeightsPublished
from actors.weights_announcements import weights_subject, why_not_published
from model.engine import GenerationEngine
from model.generation import KVPolicy
from model.weight_sync import BlobStoreLike, WeightSyncError
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from runtime.bus import Bus, Inbound
from runtime.codec import Codec

log = structlog.get_logger(__name__)

__all__ = ["WeightsFollower", "WeightsUnavailable"]


class WeightsUnavailable(TimeoutError):
    """A version was not announced (or could not be loaded) within the time allowed for it."""


class WeightsFollower:
    """Keeps ``engine`` on the newest announced version of ``run`` (see the module docstring).

    ``start`` subscribes (resources on the caller's exit stack); ``follow`` is the background loop;
    ``load_latest`` loads what is announced now (a caller may first raise the target with
    ``announce``, e.g. a rollout admitted under a newer policy than its engine has).
    """

    def __init__(
        self, bus: Bus, blob: BlobStoreLike, run: str, engine: GenerationEngine,
        *, kv_policy: KVPolicy = KVPolicy.RECOMPUTE, workers: int = 1,
    ) -> None:  # fmt: skip
        self.bus, self.run, self.engine, self.kv_policy = bus, run, engine, kv_policy
        self.subscriber = WeightSubscriber(blob, SubscriberConfig(run=run, workers=workers))
        self.latest = 0
        self.num_rejected = 0  # announcements not believed (see `_check_announcement`)
        self._changed = asyncio.Event()
        self._announced = asyncio.Event()  # replaced at each announcement: waiters hold the one they saw
        self._loading = asyncio.Lock()  # the loop and a catching-up caller may both ask
        self._codec = Codec([WeightsPublished])

    async def start(self, exit_stack: contextlib.AsyncExitStack) -> None:
        """Subscribe to the signal and learn the newest version already published."""
        exit_stack.callback(self.subscriber.close)
        sub = await self.bus.subscribe(weights_subject(self.run), self._on_signal)
        exit_stack.push_async_callback(sub.unsubscribe)
        self.announce(await self.subscriber.latest_version() or 0)
        self._changed.set()  # the first pass of follow() looks at the version known now

    def announce(self, version: int) -> None:
        """Version ``version`` exists (or will): the next load aims at least that far."""
        if version > self.latest:
            self.latest = version
            self._changed.set()
            announced, self._announced = self._announced, asyncio.Event()
            announced.set()

    async def reach(self, version: int, timeout_s: float) -> int:
        """Load ``version`` (or a newer one) into the engine once the trainer has announced it.

        Event-driven: it looks at the store once (the announcement may have gone out before this
        process subscribed), then waits for announcements, at most ``timeout_s`` in all.

        Raises:
            WeightsUnavailable: no announced version >= ``version`` could be loaded in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        looked_in_store = False
        while True:
            announced = self._announced
            if self.latest >= version:
                if await self.load_latest() >= version:
                    return self.engine.version
            elif not looked_in_store:
                looked_in_store = True
                self.announce(await self.subscriber.latest_version() or 0)
                continue
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await announced.wait()
            except TimeoutError:
                log.error("weights_wait_timeout", version=version, timeout_s=timeout_s, latest_announced=self.latest,
                          engine_version=self.engine.version)
                raise WeightsUnavailable(f"weights version {version} of run {self.run!r} was not announced (or not "
                                         f"loadable) within {timeout_s}s; newest announced {self.latest}, engine "
                                         f"at {self.engine.version}") from None

    def recheck(self) -> None:
        """Have `follow` (or a `changed` waiter) look at the newest version again: its ``wanted`` may say yes now."""
        self._changed.set()

    async def changed(self) -> int:
        """Wait for an announcement or a `recheck` since the last call; the newest announced version.

        For a caller that picks versions itself (`load`) instead of running `follow`."""
        await self._changed.wait()
        self._changed.clear()
        return self.latest

    async def load(self, version: int) -> None:
        """Load exactly ``version`` into the engine (an engine at or past it is left as it is).

        Raises:
            WeightSyncError: the version (or its chain) cannot be fetched.
        """
        async with self._loading:
            if version <= self.engine.version:
                return
            state = await self.subscriber.fetch(version)
            await self.engine.update_weights(state, version, self.kv_policy)
            log.info("weights_swapped", version=version, kv_policy=self.kv_policy.value,
                     engine=self.engine.stats().__dict__)  # fmt: skip

    async def _on_signal(self, raw: Inbound) -> None:
        try:
            msg = await self._codec.decode(raw.data)
        except ValueError as e:
            log.error("weights_signal_rejected", error=str(e))
            return
        if msg.version <= self.latest:
            return  # nothing new to act on
        reason = await why_not_published(msg, run=self.run, store=self.subscriber.store,
                                         key_prefix=self.subscriber.config.key_prefix)
        if reason is not None:
            self.num_rejected += 1
            log.warning("weights_signal_rejected", version=msg.version, key=msg.key, reason=reason,
                        num_rejected=self.num_rejected)
            return
        self.announce(msg.version)

    async def follow(
        self, *, wanted: Callable[[int], bool] | None = None,
        on_loaded: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        """Forever: on each announcement, load the newest version if ``wanted(version)``, then
        await ``on_loaded(version)`` once the engine holds it."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            target = self.latest
            if wanted is not None and not wanted(target):
                continue
            if await self.load_latest() == target and on_loaded is not None:
                await on_loaded(target)

    async def load_latest(self) -> int:
        """Load the newest announced version unless the engine has it; returns the engine's version."""
        async with self._loading:
            target = self.latest
            if target <= self.engine.version:
                return self.engine.version
            try:
                state = await self.subscriber.fetch(target)
            except WeightSyncError as e:  # keep the current weights; a later version recovers
                log.error("weights_fetch_failed", version=target, error=str(e))
                return self.engine.version
            await self.engine.update_weights(state, target, self.kv_policy)
            log.info("weights_swapped", version=target, kv_policy=self.kv_policy.value,
                     engine=self.engine.stats().__dict__)  # fmt: skip
            return self.engine.version
