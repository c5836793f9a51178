"""AdamW with decay / no-decay groups and the learning-rate schedules (warmup + cosine | WSD | constant)."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; vectors and scalars (norm weights, pseudo-queries, biases, gates) do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def lr_factor(step: int, t) -> float:
    """Multiplier of ``t.lr`` at optimizer step ``step`` (0-based)."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    floor = t.min_lr_ratio
    if t.schedule == "constant":
        return 1.0
    if t.schedule == "cosine":
        span = max(1, t.max_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # WSD: warmup, stable at the peak, then a linear decay over the last wsd_decay_fraction of steps.
    decay_steps = max(1, round(t.max_steps * t.wsd_decay_fraction))
    decay_start = t.max_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1.0 - floor) * min(1.0, (step - decay_start + 1) / decay_steps)


def build_scheduler(opt: torch.optim.Optimizer, t) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t))
