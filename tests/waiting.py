"""The tests' one bounded wait for a condition that sends no event (a run's logs, a page, host pids)."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any


async def until(predicate: Any, timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    """Polls ``predicate`` (a function, or one returning an awaitable) every ``every_s`` until it gives a truthy
    value, which is returned; an AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
