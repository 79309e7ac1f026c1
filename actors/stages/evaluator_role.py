"""The evaluator's role on the bus, apart from its model: its kind, what it may publish and read, and the
check behind its request to finish the run (``ctl.supervisor.finish``, `actors.run_end`).

Apart from `actors.stages.evaluator` (which loads the policy, so torch) because two classes play the role:
the evaluator, and the simulated one of the integration tests and benches (tests/integration/sim_stages.py),
whose processes load no torch (tests/test_import_graph.py). Both ask to finish the run and are believed
under the same check.
"""

from __future__ import annotations

from typing import Any

from actors.run_end import why_not_finished
from runtime.actor import Actor
from runtime.bus import Bus
from runtime.bus_auth import BusAccess
from runtime.supervisor import FINISH_SUBJECT

__all__ = ["EvaluatorRole"]


class EvaluatorRole(Actor):
    """The evaluator kind: it follows the weights and the reconciler's ``data_exhausted``, reads the slot
    table, reports progress and may ask the supervisor to finish the run."""

    kind = "evaluator"
    bus_access = BusAccess(publish=("progress.eval", FINISH_SUBJECT),
                           subscribe=("weights.*", "data_exhausted.*"), kv_read=("slots",))

    @classmethod
    async def why_not_finished(cls, bus: Bus, blob: Any, run: Any, config: Any, request: dict[str, Any]) -> str | None:
        return await why_not_finished(bus, blob, run, config, request)
