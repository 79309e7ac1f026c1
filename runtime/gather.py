"""Awaitables run side by side as one piece of work: the first failure stops the others."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["gather_or_cancel"]

T = TypeVar("T")


async def gather_or_cancel(*coroutines: Coroutine[Any, Any, T]) -> list[T]:
    """Their results in order, as ``asyncio.gather``; but when one fails, the others are cancelled and
    awaited before its error is raised. ``gather`` leaves them running, owned by no one: uploads past a
    failed version's, reads of a store the caller has given up on.

    (Not a TaskGroup: on Python 3.11 a child's failure caught by the caller leaves the caller's task
    marked as cancelling, so an ``asyncio.timeout`` around it later raises CancelledError; and a
    cancelled caller could get a child's error instead of its CancelledError.)"""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # cancelled meanwhile: the caller's CancelledError wins
        raise
