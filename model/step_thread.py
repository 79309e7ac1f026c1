"""The thread a generation engine runs its steps on, with its own count of intra-op (OpenMP/MKL) threads.

Why not `asyncio.to_thread` at the process's thread count: torch's CPU kernels run on libgomp, which gives
every thread that starts a parallel region its own team of worker threads. Once two teams exist (the
event loop's thread has one as soon as it ran any parallel op: loading weights, a trainer, transformers)
and they hold more threads than there are cores, libgomp throttles its spin-waits: idle workers sleep
at once, and every parallel region — each small matmul of a decode step — pays a cross-core wake.
Measured on a 2-core machine: a (16, 256) x (256, 256) matmul takes 17 us with one team and 80-95 us
once a second thread has its own; the tiny policy's engine generated 2.2k tokens/s against 3.2k with
its steps on one intra-op thread. A thread with one intra-op thread starts no team, so nothing is
throttled, neither here nor on the event loop's thread.

That holds for a small policy. A large one's decode step is a few long parallel regions that stream the
weights from memory (the 100M policy's experts alone are 47 MB a layer), where a wake per region is noise
and a second core's memory bandwidth is not: measured on two idle cores, the 100M policy decoded a batch
of 8 in 28 ms a step on two intra-op threads against 50-56 ms on one, the tiny policy's step in 6.3 ms
against 9 ms alone but slower on two once a second team exists. `auto_threads` draws the line by weight
bytes: beyond `MANY_THREADS_MIN_WEIGHT_BYTES` the process's count, below it one.

The count is per thread: ATen and MKL keep it thread-local, except that `torch.set_num_threads` also
sets the default a thread takes on its first parallel op; `step_executor` puts that default back.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch

__all__ = ["MANY_THREADS_MIN_WEIGHT_BYTES", "auto_threads", "step_executor"]

# Weights of at least this many bytes make a decode step bandwidth-bound (the tiny policy has 16 MB, the
# 100M one 430 MB): above it the step thread takes the process's intra-op threads.
MANY_THREADS_MIN_WEIGHT_BYTES = 64 * 2**20


def auto_threads(model: torch.nn.Module) -> int | None:
    """The step thread's intra-op count for ``model``: one for a small model, None (the process's) for a large one."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return None if weight_bytes >= MANY_THREADS_MIN_WEIGHT_BYTES else 1


def step_executor(intra_op_threads: int | None) -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread that runs with `intra_op_threads` intra-op threads (None: the process's count).

    Blocks until the thread is set up (the process default is restored from the calling thread).
    """
    if intra_op_threads is None:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
    default = torch.get_num_threads()
    ready = threading.Event()

    def set_up() -> None:
        torch.get_num_threads()  # a thread's first use copies the process default; set ours after that
        torch.set_num_threads(intra_op_threads)
        ready.set()

    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="engine-step", initializer=set_up
    )
    executor.submit(lambda: None).result()  # starts the thread, runs set_up
    ready.wait()
    torch.set_num_threads(default)  # back to the calling thread's count, as the default for new threads
    return executor
