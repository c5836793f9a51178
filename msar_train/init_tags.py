"""How a parameter wants to be initialised: a tag set where the parameter is made (``residual/``,
``model/``), read by ``model/init.py`` when it initialises a layer. A leaf module (torch only), so that
the residual backends tag their parameters without importing ``model/`` (which imports them).
"""

from __future__ import annotations

import torch
from torch import nn

ATTR = "_msar_init"


def tag_init(p: nn.Parameter, kind: str, value: float | None = None) -> nn.Parameter:
    """kind: normal (value = std) | zeros | ones | const (value) | eye (value * I) | causal_mix (value = s)."""
    setattr(p, ATTR, (kind, value))
    return p


@torch.no_grad()
def causal_mix_(p: torch.Tensor, s: float) -> torch.Tensor:
    """Conv taps ``[K, D]``, tap 0 = the current token: ``(1 - s) * delta + s / K`` (identity to moving average)."""
    p.fill_(s / p.shape[0])
    p[0] += 1.0 - s
    return p
