"""Activation checkpointing of pipeline-ready layers (tuple carries), without DeepSpeed.

``checkpoint(fn, *args)`` is ``torch.utils.checkpoint.checkpoint`` non-reentrant (the reentrant variant and
DeepSpeed's default checkpoint function do not handle tuple payloads whose first float has no grad), with
``recomputing()`` true while backward recomputes the forward. Modules with forward side effects that must
happen once per forward (the MoE load counters) check it. The same function serves the single-process
``Transformer`` and the pipeline module (``activation_checkpoint_func``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.utils.checkpoint

_depth = 0  # > 0 while a checkpointed forward is being recomputed


def recomputing() -> bool:
    return _depth > 0


class _RecomputeRegion:
    """Re-entrant: one checkpoint may be recomputed several times (DeepSpeed's pipe engine runs one
    ``backward(retain_graph=True)`` per stage output), so a one-shot generator context would not do."""

    def __enter__(self) -> None:
        global _depth
        _depth += 1

    def __exit__(self, *exc) -> None:
        global _depth
        _depth -= 1


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _RecomputeRegion()


def checkpoint(fn: Callable, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)
