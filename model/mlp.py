"""The dense SwiGLU MLP of Llama and Qwen3, beside `model.moe.MoEBlock` (the config chooses which).

Legend: T tokens, D hidden size, I intermediate size.

Parameter names follow Hugging Face (`mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`), so dense checkpoints
load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig

__all__ = ["DenseMLP"]


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); biases only for Llama's `mlp_bias`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))
