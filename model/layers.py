"""Small building blocks: RMSNorm and rotary position embeddings (Qwen3 / Llama conventions).

Legend: T tokens, H heads, Hd head dim, D hidden size, R = Hd / 2 rotary frequencies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import Llama3RopeScaling

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary", "llama3_inv_freq"]


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in (at least) fp32, cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: the numbers of x * rsqrt(mean(x^2) + eps) in one op instead of five
        x32 = x if x.dtype == torch.float64 else x.float()
        return self.weight * F.rms_norm(x32, (x32.shape[-1],), eps=self.eps).to(x.dtype)


def llama3_inv_freq(inv_freq_R: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's rescaled frequencies: long wavelengths slowed by `factor`, short ones kept, a smooth band between.

    With wavelength w = 2π / f and the original context C: w > C / low_freq_factor gives f / factor;
    w < C / high_freq_factor keeps f; between, f·((1 − s) / factor + s) with s = (C / w − low) / (high − low).
    """
    context = scaling.original_max_position_embeddings
    wavelen_R = 2 * math.pi / inv_freq_R
    slowed_R = torch.where(wavelen_R > context / scaling.low_freq_factor, inv_freq_R / scaling.factor, inv_freq_R)
    smooth_R = (context / wavelen_R - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended_R = (1 - smooth_R) * slowed_R / scaling.factor + smooth_R * slowed_R
    in_band_R = (wavelen_R >= context / scaling.high_freq_factor) & (wavelen_R <= context / scaling.low_freq_factor)
    return torch.where(in_band_R, blended_R, slowed_R)


class RotaryEmbedding(nn.Module):
    """RoPE: inv_freq_i = theta^(-2i/Hd), optionally rescaled (llama3); cos/sin for arbitrary position ids."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables `apply_rotary` takes: cos and sign-folded sin, (T, 1, Hd) to broadcast over heads.

        Rotate-half is x * cos + [-x2, x1] * sin; the minus sign moves onto the first half of sin here, once per
        forward, rather than onto x in every layer for q and for k (negation is exact: same numbers).
        """
        freqs_TR = position_ids_T[:, None].float() * self.inv_freq.to(position_ids_T.device)
        emb_THd = torch.cat((freqs_TR, freqs_TR), dim=-1)
        sin_THd = emb_THd.sin().to(dtype)
        half = sin_THd.shape[-1] // 2
        signed_sin_THd = torch.cat((-sin_THd[:, :half], sin_THd[:, half:]), dim=-1)
        return emb_THd.cos().to(dtype)[:, None, :], signed_sin_THd[:, None, :]


def apply_rotary(x_THHd: torch.Tensor, cos_T1Hd: torch.Tensor, signed_sin_T1Hd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on (T, heads, Hd) with the tables of `RotaryEmbedding.forward`: x * cos + [x2, x1] * sin."""
    return x_THHd * cos_T1Hd + x_THHd.roll(x_THHd.shape[-1] // 2, dims=-1) * signed_sin_T1Hd
