"""The engine's step thread: its own intra-op thread count, the rest of the process untouched."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from model.config import medium_100m, tiny
from model.errors import ConfigError
from model.generation import EngineConfig
from model.step_thread import auto_threads, step_executor
from model.transformer import MoETransformer


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


def test_auto_threads_one_for_a_small_policy_the_process_count_for_a_large_one() -> None:
    """A small policy's decode step is many short parallel regions (one thread: no second OpenMP team to wake);
    a large one's streams its weights from memory, and a second core's bandwidth pays."""
    assert EngineConfig().intra_op_threads == "auto"
    assert auto_threads(MoETransformer(tiny())) == 1
    with torch.device("meta"):  # the 100M policy's parameters, without allocating them
        assert auto_threads(MoETransformer(medium_100m())) is None


@pytest.mark.parametrize("threads", [0, -1, "all", 1.5])
def test_engine_config_refuses_other_thread_counts(threads: object) -> None:
    with pytest.raises(ConfigError, match="intra_op_threads"):
        EngineConfig(intra_op_threads=threads)  # type: ignore[arg-type]
