"""Shared helpers for the kernel tests."""

from __future__ import annotations

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """20 log10(||ref|| / ||ref - approx||) in float64."""
    ref = reference.detach().double()
    err = (ref - approx.detach().double()).norm()
    return float(20 * torch.log10(ref.norm() / err))


def all_bf16_values() -> torch.Tensor:
    """Every one of the 65,536 bf16 bit patterns, as a (2048, 32) bf16 tensor."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Rows of zeros, subnormals, infinities, NaNs and huge values (blocks of 32)."""
    inf, nan = float("inf"), float("nan")
    f32_sub = 1e-40 if dtype == torch.float32 else 1e-39
    huge = 3e38 if dtype == torch.float32 else 3.3e38
    rows = [
        [0.0] * 32,
        [-0.0] * 16 + [0.0] * 16,
        [f32_sub] * 31 + [-f32_sub],
        [2.0**-130] * 32,
        [2.0**-118] * 16 + [-(2.0**-119)] * 16,
        [inf] + [1.0] * 31,
        [-inf] + [1.0] * 30 + [inf],
        [nan] + [1.0] * 31,
        [nan] + [-3.0, inf, -inf, 0.0, -0.0] + [2.0] * 26,
        [huge] + [1.0] * 31,
        [-huge] + [1e-30] * 31,
        [448.0 * 2.0**k for k in range(-16, 16)],
        [1.0 + 2.0**-7 * k for k in range(32)],
        [464.0, 480.0, 447.9, -465.0] + [0.5] * 28,
        [3.4e38, -3.39e38, 3.3e38, 2.99e38] + [1.0] * 28,  # RCEIL scale 247: saturate at 240 * 2^120
        [1e-40, -(2.0**-127), 2.0**-149, 1.5 * 2.0**-124] + [2.0**-126] * 28,  # scale byte 0 = 2^-127
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


def mixed_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of randn at magnitudes spread over many decades, a fifth of the entries heavy-tailed (ratios)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 6)
    heavy = torch.randn(rows, cols, generator=g) / torch.randn(rows, cols, generator=g)
    return torch.where(torch.rand(rows, cols, generator=g) < 0.2, heavy, x)


def grouped_reference(
    x_MK: torch.Tensor, w_ENK: torch.Tensor, dout_MN: torch.Tensor, offsets_E1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out = x W_e^T, dX = dout W_e, dW_e = dout_e^T x_e in float64, expert by expert."""
    x, w, dout = x_MK.double(), w_ENK.double(), dout_MN.double()
    out, dx = torch.zeros(dout.shape, dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    bounds = offsets_E1.tolist()
    for e in range(w.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        out[s:t] = x[s:t] @ w[e].t()
        dx[s:t] = dout[s:t] @ w[e]
        dw[e] = dout[s:t].t() @ x[s:t]
    return out, dx, dw
