"""A real rollout actor with a fault injected into its real engine (apart from workers.py: it imports torch)."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.stages.rollout import RolloutActor
from runtime.actor import Delivery
from tests.integration.workers import first_time_in_run


class WedgingRolloutActor(RolloutActor):
    """The real rollout actor whose real engine wedges after its first finished rollout, in the first process
    of the run only: every generate from then on (the episodes' and the health probe's one token) waits
    forever, as on a hung device, while the process lives and answers pings."""

    async def handle(self, msg: Any, delivery: Delivery) -> None:
        await super().handle(msg, delivery)
        if first_time_in_run(self.ctx.run_dir, "wedge-engine"):
            self._log.warning("test_fault_injected", fault="the generation engine wedges from now on")
            self.engine.generate = _wedged  # type: ignore[method-assign]


async def _wedged(*args: Any, **kwargs: Any) -> Any:
    await asyncio.Event().wait()
