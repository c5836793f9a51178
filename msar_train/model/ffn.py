"""SwiGLU feed-forward block, shared by the dense FFN layers and by every MoE expert.

Legend: N = tokens (any leading shape), D = d_model, H = hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``w_down(silu(w_gate x) * w_up x)``; bias-free like the LLaMA/DeepSeek FFNs."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.hidden = hidden
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        h_NH = F.silu(self.w_gate(x_ND)) * self.w_up(x_ND)
        return self.w_down(h_NH)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, hidden={self.hidden}"
