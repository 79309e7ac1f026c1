"""A task's cancellation that a library's wait swallowed, raised again.

Python 3.11's ``asyncio.wait_for`` returns its inner future's result (or raises its error) when the task
awaiting it is cancelled in the loop turn where that future completes: the CancelledError is lost, yet the task
stays marked as cancelling (`asyncio.Task.cancelling`), and it goes on as if nothing had been asked. nats-py waits
that way in its requests, flushes, JetStream API calls and subscription reads, and its flush of pending writes
catches CancelledError outright. A task cancelled at such a moment (an actor's loop on drain, a feed whose page
closed) then runs on: a watch being opened goes on to wait for changes, and its actor never stops.

`runtime.bus`, the one module that awaits nats-py, leaves every such await inside `cancellation_kept`, so that
a cancellation reaches its caller whatever nats-py did with it. `raise_if_cancelled` is for a loop whose awaits
are some other library's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["cancellation_kept", "raise_if_cancelled"]


@contextlib.contextmanager
def cancellation_kept() -> Iterator[None]:
    """On leaving the block, a cancellation of the current task requested inside it and swallowed there (the
    block returned, or raised something else) is raised again as CancelledError.

    Only a cancellation asked for inside the block counts: a task that was cancelling before it (one that
    goes on to clean up after its cancellation) is not stopped by its own clean-up's calls. Outside a task it
    does nothing.
    """
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    try:
        yield
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError from e  # the cancellation came with (or caused) this error: it wins
        raise
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError


def raise_if_cancelled() -> None:
    """Raises CancelledError if the current task has been cancelled (and not uncancelled) at any point: for a
    loop that awaits a library other than nats-py (whose awaits `runtime.bus` guards) that may swallow its
    cancellation as Python 3.11's ``asyncio.wait_for`` does; without it the cancelled loop goes on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
