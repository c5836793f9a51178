"""Deterministic, partition-independent parameter initialisation.

Every parameter is initialised from its own generator seeded by ``(seed, global layer index,
parameter name)``, so a layer gets the same weights whether it is built in one process or on one
stage of a pipeline, in any order. Parameters carry their rule as a tag (``tag_init``); untagged
matrices (Linear, Embedding) get ``normal(0, init_std)``, untagged vectors keep their constructor
value (norm weights = 1).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from msar_train.init_tags import ATTR as _ATTR
from msar_train.init_tags import causal_mix_


def _generator(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()) & 0x7FFFFFFF)


@torch.no_grad()
def init_parameter(p: torch.Tensor, key: str, seed: int, default_std: float) -> None:
    kind, value = getattr(p, _ATTR, ("normal", default_std) if p.dim() >= 2 else ("keep", None))
    if kind == "normal":
        std = default_std if value is None else value
        p.copy_(torch.randn(p.shape, generator=_generator(seed, key), dtype=torch.float32) * std)
    elif kind == "zeros":
        p.zero_()
    elif kind == "ones":
        p.fill_(1.0)
    elif kind == "const":
        p.fill_(value)
    elif kind == "causal_mix":
        causal_mix_(p, value)
    elif kind == "eye":
        p.copy_(torch.eye(p.shape[-1], dtype=p.dtype) * value)
    elif kind != "keep":
        raise AssertionError(f"unknown init kind {kind!r} for {key}")


def init_layer_(layer: nn.Module, seed: int, layer_idx: int, default_std: float) -> None:
    """Initialise one layer of ``Transformer.layers()`` (global index ``layer_idx``).

    Parameters shared between layers (MSAR source expansions) use constant inits, so every copy of
    them (one per pipeline stage) starts identical whatever key they are reached under."""
    for name, p in layer.named_parameters():
        if p.device.type != "meta":
            init_parameter(p, f"{layer_idx}/{name}", seed, default_std)
