"""Real actors with one injected fault each, for the fault tests (entries like ``tests.integration.faulty_actors:X``).

Each fault fires in the first process of its kind in a run only (a marker file in the run directory
says it fired), so the process the supervisor starts in its place shows the recovery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.rollout import RolloutActor


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
