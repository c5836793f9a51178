"""Residual backends behind one protocol (see ``base.py``); variants register themselves by name."""

from msar_train.residual.base import (
    REGISTRY,
    ResidualBackend,
    ResidualSite,
    SeqContext,
    build_backend,
    register,
)

# Importing the variant modules registers them.
from msar_train.residual import attnres, mhc, msar, vanilla  # noqa: E402,F401

__all__ = ["REGISTRY", "ResidualBackend", "ResidualSite", "SeqContext", "build_backend", "register"]
