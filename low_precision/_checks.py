"""Input validation shared by the reference functions and the Triton launchers."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from low_precision.errors import KernelDTypeError, KernelShapeError, KernelStrideError


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise KernelDTypeError(f"{name} must have dtype in ({names}); got {t.dtype}. Cast it first.")


def check_rank(name: str, t: torch.Tensor, rank: int, legend: str) -> None:
    if t.dim() != rank:
        raise KernelShapeError(f"{name} must be {rank}-D ({legend}); got shape {tuple(t.shape)}")


def check_size(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise KernelShapeError(f"{name}.shape[{dim}] must equal {what} = {expected}; got shape {tuple(t.shape)}")


def check_multiple(name: str, value: int, multiple: int, what: str) -> None:
    if value % multiple != 0:
        raise KernelShapeError(
            f"{name}: {what} = {value} must be a multiple of {multiple}; pad the tensor to a multiple"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise KernelStrideError(
            f"{name} must be contiguous (row-major); got strides {t.stride()} for shape {tuple(t.shape)}."
            " Call .contiguous() first."
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise KernelStrideError(f"all tensors must be on one device; got {devices}")


def check_offsets(name: str, offsets: torch.Tensor, num_rows: int) -> None:
    """Group offsets: 1-D integer tensor of E+1 non-decreasing values from 0 to ``num_rows``."""
    check_dtype(name, offsets, (torch.int32, torch.int64))
    check_rank(name, offsets, 1, "E+1 group boundaries")
    if offsets.numel() < 2:
        raise KernelShapeError(f"{name} needs at least 2 entries (E+1 for E >= 1); got {offsets.numel()}")
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != num_rows:
        raise KernelShapeError(f"{name} must run from 0 to {num_rows} rows; got {first}..{last}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise KernelShapeError(f"{name} must be non-decreasing; got {offsets.tolist()}")
