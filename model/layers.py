"""Small building blocks: RMSNorm and rotary position embeddings (Qwen3 conventions).

Legend: T tokens, H heads, Hd head dim, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary"]


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in (at least) fp32, cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float64 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE: inv_freq_i = theta^(-2i/Hd); cos/sin computed for arbitrary position ids."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_TR = position_ids_T[:, None].float() * self.inv_freq.to(position_ids_T.device)
        emb_THd = torch.cat((freqs_TR, freqs_TR), dim=-1)
        return emb_THd.cos().to(dtype), emb_THd.sin().to(dtype)


def apply_rotary(x_THHd: torch.Tensor, cos_THd: torch.Tensor, sin_THd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on (T, heads, Hd) with per-token cos/sin of shape (T, Hd)."""
    half = x_THHd.shape[-1] // 2
    rotated = torch.cat((-x_THHd[..., half:], x_THHd[..., :half]), dim=-1)
    return x_THHd * cos_THd[:, None, :] + rotated * sin_THd[:, None, :]
