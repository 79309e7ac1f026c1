"""A placed actor process as the supervisor sees one (`runtime.placement.PlacedProcess`), for the supervisor's unit
tests: it exits when told to (`exit`, or a kill); a signal changes nothing (the tests' bus doubles answer the drain)."""

from __future__ import annotations

import asyncio
from typing import Any


class PlacedProcessDouble:
    node, lost = "local", None

    def __init__(self, pid: int = 4242) -> None:
        self.pid = pid
        self.exited = asyncio.Event()
        self.returncode: int | None = None

    async def wait(self) -> int:
        await self.exited.wait()
        return 0

    def exit(self) -> None:
        self.returncode = 0
        self.exited.set()

    def send_signal(self, sig: Any) -> None:
        pass

    async def kill(self) -> None:
        self.exit()

    def output_tail(self) -> str:
        return "logs/worker-1-ab.out"
