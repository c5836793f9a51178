"""Residual backends behind one protocol (see ``base.py``); variants register themselves by name."""

# Importing the variant modules registers them.
from msar_train.residual import attnres, mhc, msar, vanilla  # noqa: E402,F401
from msar_train.residual.base import (
    REGISTRY,
    ResidualBackend,
    ResidualSite,
    SeqContext,
    build_backend,
    register,
)

__all__ = ["REGISTRY", "ResidualBackend", "ResidualSite", "SeqContext", "build_backend", "register"]
