"""Awaitables run side by side as one piece of work: the first failure stops the others."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["gather_or_cancel"]

T = TypeVar("T")


async def gather_or_cancel(*coroutines: Coroutine[Any, Any, T]) -> list[T]:
    """Their results in order, as ``asyncio.gather``; but when one fails, the others are cancelled and
    awaited before its error (itself, not an ExceptionGroup) is raised. ``gather`` leaves them running,
    owned by no one: uploads past a failed version's, reads of a store the caller has given up on."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]
