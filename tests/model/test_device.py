"""policy.device: the spec is checked when the config is read; a GPU that is not there is an error, never
a silent fall back to the CPU."""

from __future__ import annotations

import pytest
import torch

from model.device import resolve_device
from model.device_spec import check_device_spec
from model.errors import ConfigError


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_well_formed_specs_pass(spec: str) -> None:
    check_device_spec(spec)


@pytest.mark.parametrize("spec", ["", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "mps ", "cpu:0", "auto,cpu"])
def test_malformed_specs_are_refused_naming_the_key_and_the_choices(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"policy\.device=.*use auto, cpu, cuda or cuda:N"):
        check_device_spec(spec)


def test_auto_is_cuda_exactly_when_the_process_has_a_gpu() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_this_process_lacks_is_an_error_not_the_cpu(spec: str) -> None:
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        resolve_device(spec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_index_past_the_last_is_an_error() -> None:
    with pytest.raises(ConfigError, match="GPU\\(s\\)"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
