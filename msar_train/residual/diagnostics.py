"""Switch residual diagnostics on for a few forwards and collect what the modules recorded.

    with record_diagnostics(model) as rec:
        model(ids_BT)                      # any number of forwards: values are averaged over them
    for d in rec.records:                  # filled when the block exits
        d.name, d.target_index, d.values   # e.g. values["depth_alpha"] [S, M]

Works on any module tree that contains ``Diagnosable`` residual modules (the single-process
Transformer, a pipeline stage). Which keys a module records is its backend's business; the keys in
use (``depth_alpha``, ``depth_entropy``, ``fusion_weights``, ``mhc_ds_err``, ``mhc_hres``) are
documented where they are recorded (``depth.py: depth_diagnostics``, ``mhc.py: hres_diagnostics``).
Nothing stays stored in the modules after the block: recording off means no retained tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from msar_train.residual.base import Diagnosable


@dataclass
class SiteDiagnostics:
    name: str  # qualified module name inside the recorded model
    target_index: int | None  # the spec's l (1..L sites, L+1 output aggregation)
    values: dict[str, torch.Tensor]  # fp32, on the CPU


@dataclass
class Recording:
    records: list[SiteDiagnostics] = field(default_factory=list)


def diagnosable_modules(model: nn.Module) -> list[tuple[str, Diagnosable]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Diagnosable)]


@contextmanager
def record_diagnostics(model: nn.Module) -> Iterator[Recording]:
    """Record diagnostics in every supporting module for the forwards run inside the block.

    The ``Recording`` is filled on exit with one entry per module that recorded something (modules
    that support nothing, e.g. vanilla sites, are left out), in module order.
    """
    mods = diagnosable_modules(model)
    for _, m in mods:
        m.clear_diagnostics()
        m.recording = True
    rec = Recording()
    try:
        yield rec
    finally:
        for name, m in mods:
            values = m.diagnostics()
            if values:
                rec.records.append(SiteDiagnostics(name, m.target_index, {k: v.cpu() for k, v in values.items()}))
            m.clear_diagnostics()
            m.__dict__.pop("recording", None)  # back to the class default (off)


__all__ = ["Recording", "SiteDiagnostics", "diagnosable_modules", "record_diagnostics"]
