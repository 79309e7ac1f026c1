"""Lowering the scheduling priority of the calling thread (Linux: nice and policy are per thread)."""

from __future__ import annotations

import os
import threading

import structlog

__all__ = ["lower_thread_priority"]

log = structlog.get_logger(__name__)


def lower_thread_priority(nice: int, idle: bool) -> None:
    """Raise this thread's nice value to at least ``nice``; with ``idle``, also SCHED_IDLE.

    Meant as a ThreadPoolExecutor initializer, so background encoding competes less with the
    training step for CPU. Lowering priority needs no privilege; failures are logged, not raised.
    """
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > current:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        if idle and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # not Linux, or a sandbox that forbids it: run at normal priority
        log.warning("weights_worker_priority_unchanged", nice=nice, idle=idle, error=str(exc))
