"""The engine's step thread: its own intra-op thread count, the rest of the process untouched."""

from __future__ import annotations

import concurrent.futures

import torch

from model.step_thread import step_executor


def test_step_thread_has_its_own_count_and_leaves_the_process_default() -> None:
    before = torch.get_num_threads()
    executor = step_executor(1)
    try:
        assert executor.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == before
        with concurrent.futures.ThreadPoolExecutor(1) as fresh:  # a thread's first use takes the default
            assert fresh.submit(torch.get_num_threads).result() == before
    finally:
        executor.shutdown()


def test_none_keeps_the_process_count() -> None:
    executor = step_executor(None)
    try:
        assert executor.submit(torch.get_num_threads).result() == torch.get_num_threads()
    finally:
        executor.shutdown()
