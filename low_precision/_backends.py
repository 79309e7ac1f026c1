"""The two implementations of the quantized experts' building blocks: torch emulation and Triton.

Both expose the same operations on the same data types, so the autograd op is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from low_precision import grouped_gemm, grouped_gemm_triton, mxfp8, mxfp8_triton, nvfp4, nvfp4_triton
from low_precision.errors import KernelDeviceError
from low_precision.formats import ScaleMode
from low_precision.mxfp8 import MXTensor, PaddedGroups
from low_precision.nvfp4 import NVFP4Tensor

__all__ = ["EMULATED", "TRITON", "QuantBackend", "take_rows", "triton_interpreted"]


@dataclass(frozen=True)
class QuantBackend:
    """Quantizers and grouped GEMMs of one implementation (see :mod:`low_precision.experts`)."""

    name: str
    nvfp4_rows: Callable[[torch.Tensor], NVFP4Tensor]
    nvfp4_experts: Callable[[torch.Tensor], NVFP4Tensor]
    nvfp4_mm: Callable[[NVFP4Tensor, NVFP4Tensor, torch.Tensor], torch.Tensor]
    mx_rows: Callable[[torch.Tensor, ScaleMode], MXTensor]
    mx_experts: Callable[[torch.Tensor, ScaleMode], MXTensor]
    mx_grouped_cols: Callable[[torch.Tensor, PaddedGroups, ScaleMode], MXTensor]
    mx_mm: Callable[[MXTensor, MXTensor, torch.Tensor], torch.Tensor]
    mx_wgrad: Callable[[MXTensor, MXTensor, torch.Tensor], torch.Tensor]
    check_device: Callable[[torch.device], None]


def take_rows(q: NVFP4Tensor, index_M: torch.Tensor) -> NVFP4Tensor:
    """The per-token NVFP4 rows ``index_M`` (quantize once per token, gather per routed pair)."""
    return NVFP4Tensor(
        packed=q.packed[index_M].contiguous(),
        block_scales=q.block_scales[index_M].contiguous(),
        global_amax=q.global_amax[index_M].contiguous(),
    )


def _any_device(device: torch.device) -> None:
    del device


def triton_interpreted() -> bool:
    """Whether the Triton kernels, as imported now, run under the interpreter (TRITON_INTERPRET=1 was set
    when their modules were imported) rather than compiled."""
    return not isinstance(nvfp4_triton._nvfp4_quant_kernel, triton.runtime.JITFunction)


def _triton_device(device: torch.device) -> None:
    if device.type == "cuda":
        return
    interpreted = triton_interpreted()
    if device.type != "cpu" or not interpreted:
        raise KernelDeviceError(
            f"the Triton experts need a CUDA device, or CPU tensors with TRITON_INTERPRET=1 set before"
            f" triton is imported; got device {device} (interpreted={interpreted})"
        )


EMULATED = QuantBackend(
    name="emulated",
    nvfp4_rows=nvfp4.nvfp4_quantize,
    nvfp4_experts=nvfp4.nvfp4_quantize_experts,
    nvfp4_mm=grouped_gemm.nvfp4_grouped_mm,
    mx_rows=lambda x, mode: mxfp8.mxfp8_quantize(x, dim=-1, mode=mode),
    mx_experts=mxfp8.mxfp8_quantize_experts,
    mx_grouped_cols=mxfp8.mxfp8_quantize_grouped_cols,
    mx_mm=grouped_gemm.mxfp8_grouped_mm,
    mx_wgrad=grouped_gemm.mxfp8_grouped_wgrad,
    check_device=_any_device,
)

TRITON = QuantBackend(
    name="triton",
    nvfp4_rows=nvfp4_triton.triton_nvfp4_quantize,
    nvfp4_experts=nvfp4_triton.triton_nvfp4_quantize_experts,
    nvfp4_mm=grouped_gemm_triton.triton_nvfp4_grouped_mm,
    mx_rows=mxfp8_triton.triton_mxfp8_quantize_rows,
    mx_experts=mxfp8_triton.triton_mxfp8_quantize_experts,
    mx_grouped_cols=mxfp8_triton.triton_mxfp8_quantize_grouped_cols,
    mx_mm=grouped_gemm_triton.triton_mxfp8_grouped_mm,
    mx_wgrad=grouped_gemm_triton.triton_mxfp8_grouped_wgrad,
    check_device=_triton_device,
)
