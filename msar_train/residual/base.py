"""The residual-backend protocol.

A residual backend turns the usual ``h + f(h)`` into something richer. What it carries between
branches is a fixed-arity tuple of tensors (its *state*): exactly what a pipeline engine sends
between stages. Blocks never learn what is inside the state; they only hand each site a branch
callable ``h_BTD -> f(h_BTD)``.

Legend: B batch, T sequence, D d_model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

State = tuple[torch.Tensor, ...]
Branch = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SeqContext:
    """Per-batch sequence facts every branch and residual site may need.

    doc_ids_BT: document id of each token (None = one document per row: plain causal masking).
    positions_BT: RoPE positions (None = 0..T-1, or continuing the cache); reset per document under
    document masking.
    cache: incremental decoding (``model/cache.py:DecodeCache``): the tensors cover only the new
    tokens, and modules that read earlier tokens (attention, MSAR's convolutions) take them from the
    cache and file the new ones there. None in training and in a full forward.
    """

    doc_ids_BT: torch.Tensor | None = None
    positions_BT: torch.Tensor | None = None
    cache: Any = None


class Diagnosable:
    """Mixin for residual modules (sites, exits) that can record diagnostics of their forward.

    ``residual/diagnostics.py:record_diagnostics`` sets ``recording`` on an instance for a while;
    the class default keeps it off, so an unrecorded forward pays one attribute check. Recorded
    values are summed over the forwards of one recording and ``diagnostics()`` returns their mean.
    ``target_index`` is the spec's ``l`` the module serves (1..L for sites, L+1 for the output
    aggregation); None when the module does not know it.
    """

    recording: bool = False
    target_index: int | None = None

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Means over the forwards recorded since the last ``clear_diagnostics`` ({} when none)."""
        acc = self.__dict__.get("_diag_acc")
        return {k: total / n for k, (total, n) in acc.items()} if acc else {}

    def clear_diagnostics(self) -> None:
        self.__dict__.pop("_diag_acc", None)

    def record(self, values: dict[str, torch.Tensor]) -> None:
        """Add one forward's values (detached, fp32) to the running sums."""
        acc = self.__dict__.setdefault("_diag_acc", {})
        for k, v in values.items():
            total, n = acc.get(k, (0.0, 0))
            acc[k] = (v.detach().float() + total, n + 1)


class ResidualSite(Diagnosable, nn.Module, ABC):
    """One residual branch's connection: ``forward(state, branch, ctx) -> state``.

    Sites that support diagnostics record them in ``forward`` when ``self.recording`` is set
    (see ``Diagnosable``); the default records nothing and ``diagnostics()`` returns ``{}``.
    """

    @abstractmethod
    def forward(self, state: State, branch: Branch, ctx: SeqContext) -> State: ...


class ResidualBackend(ABC):
    """Factory for the modules of one residual variant, built once per model.

    ``n_branches`` = L = 2 * n_layers; branch ``l`` (1-based, as in the spec) is sublayer
    ``sublayer`` (0 = attention, 1 = FFN/MoE) of block ``layer_idx``: ``l = 2 * layer_idx + sublayer + 1``.
    """

    name: ClassVar[str]

    def __init__(self, cfg, n_layers: int, d_model: int, norm_eps: float, init_std: float):
        self.cfg = cfg
        self.n_layers = n_layers
        self.n_branches = 2 * n_layers
        self.d_model = d_model
        self.norm_eps = norm_eps
        self.init_std = init_std

    @abstractmethod
    def build_entry(self) -> nn.Module:
        """Module mapping the embedding output h_BTD to the initial state (lives in EmbedLayer)."""

    @abstractmethod
    def build_site(self, layer_idx: int, sublayer: int) -> ResidualSite:
        """The site for one branch (lives in its Block)."""

    @abstractmethod
    def build_exit(self) -> nn.Module:
        """Module mapping ``(state, ctx)`` to h_BTD before the final norm (lives in HeadLayer)."""

    @abstractmethod
    def state_shapes(self, after_layer: int, batch: int, seq: int) -> list[tuple[int, ...]]:
        """Shapes of the state tensors after ``after_layer`` transformer blocks (0 = after the
        embedding). This is what crosses a pipeline cut placed there."""

    @abstractmethod
    def forward_flops_per_token(self) -> float:
        """FLOPs of this backend's own math (everything but the branches) in one forward, per token
        (a multiply-add = 2). ``model/flops.py`` adds it to the model's matmul count."""

    @abstractmethod
    def site_activation_bytes(self, layer_idx: int, sublayer: int, batch: int, seq: int, elem: int) -> int:
        """Bytes one site keeps for backward per micro-batch (its new state included, the branch's own
        tensors excluded); ``elem`` = bytes per activation element. ``parallel/memory.py`` adds them up."""

    def exit_activation_bytes(self, batch: int, seq: int, elem: int) -> int:
        """Bytes the exit module keeps for backward per micro-batch (0: it only reads the state)."""
        return 0

    def site_backward_bytes(self, layer_idx: int, sublayer: int, batch: int, seq: int, elem: int, checkpointed: bool) -> int:
        """Extra bytes live while this site runs its backward, beyond the layer's carries and their
        gradients (workspace the backward recomputes, and state it holds across layers); 0 by default.
        ``layer_idx = n_layers`` is the exit."""
        return 0

    def state_names(self, after_layer: int) -> list[str]:
        """Names of the ``state_shapes(after_layer, ...)`` tensors, in order (for ``msar-plan``)."""
        return [f"state{i}" for i in range(len(self.state_shapes(after_layer, 1, 1)))]

    def is_cut_point(self, after_layer: int) -> bool:
        """Whether a pipeline cut after ``after_layer`` blocks sends no partial state (block-aligned)."""
        return True

    def shared_modules(self) -> dict[str, nn.Module]:
        """Modules built by this process that several layers share (keyed stably across processes).
        Under pipeline parallelism each stage holding one keeps a replica; the engine sums their
        gradients over those stages, like tied embeddings."""
        return {}

    def branch_index(self, layer_idx: int, sublayer: int) -> int:
        return 2 * layer_idx + sublayer + 1


REGISTRY: dict[str, type[ResidualBackend]] = {}


def register(cls: type[ResidualBackend]) -> type[ResidualBackend]:
    REGISTRY[cls.name] = cls
    return cls


def build_backend(cfg, n_layers: int, d_model: int, norm_eps: float, init_std: float) -> ResidualBackend:
    if cfg.name not in REGISTRY:
        raise ValueError(f"residual.name={cfg.name!r} is not one of {sorted(REGISTRY)}")
    return REGISTRY[cfg.name](cfg, n_layers, d_model, norm_eps, init_std)
