"""The DeepSeekMoE Transformer: a list of pipeline-ready layers whose fold is the forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from msar_train.model.cache import DecodeCache
from msar_train.model.init import init_layer_
from msar_train.model.layers import Block, EmbedLayer, HeadLayer
from msar_train.model.moe import MoE
from msar_train.model.recompute import checkpoint
from msar_train.residual import build_backend
from msar_train.residual.base import SeqContext


def layer_specs(model_cfg, backend, document_mask: bool = False) -> list[tuple[type, tuple]]:
    """``(class, args)`` of every entry of ``Transformer.layers()``: the one recipe that both the
    single-process model and a pipeline engine (LayerSpec) build from. Untied head; the Transformer
    ties it itself when asked."""
    return [
        (EmbedLayer, (model_cfg, backend, document_mask)),
        *[(Block, (model_cfg, backend, i, document_mask)) for i in range(model_cfg.n_layers)],
        (HeadLayer, (model_cfg, backend, document_mask)),
    ]


class Transformer(nn.Module):
    """``layers()`` = ``[EmbedLayer, Block x n_layers, HeadLayer]``; ``forward`` folds over it.

    Weights are initialised per layer from ``seed`` (``model/init.py``), so any contiguous slice of
    ``layers()`` built elsewhere (a pipeline stage) gets identical parameters.

    ``activation_checkpointing``: in training, each block's activations are recomputed in backward
    (``model/recompute.py``) instead of being kept; set by whoever runs the model (the engine).
    """

    activation_checkpointing: bool = False

    def __init__(self, model_cfg, residual_cfg, document_mask: bool = False, seed: int = 0):
        super().__init__()
        self.cfg = model_cfg
        self.document_mask = document_mask
        self.backend = build_backend(residual_cfg, model_cfg.n_layers, model_cfg.d_model, model_cfg.norm_eps, model_cfg.init_std)
        specs = layer_specs(model_cfg, self.backend, document_mask)
        self.embed = specs[0][0](*specs[0][1])
        self.blocks = nn.ModuleList(cls(*args) for cls, args in specs[1:-1])
        tied = self.embed.tok if model_cfg.tie_embeddings else None
        self.head = specs[-1][0](*specs[-1][1], tied=tied)
        self.reset_parameters(seed)

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def reset_parameters(self, seed: int) -> None:
        for idx, layer in enumerate(self.layers()):
            init_layer_(layer, seed, idx, self.cfg.init_std)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.blocks if b.is_moe]

    def forward(self, ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None = None, positions_BT: torch.Tensor | None = None):
        """Returns ``(logits_BTV, aux_loss)``."""
        x = (ids_BT, doc_ids_BT, positions_BT) if self.document_mask else ids_BT
        for layer in self.layers():
            if self.activation_checkpointing and isinstance(layer, Block) and torch.is_grad_enabled():
                x = checkpoint(layer, x)
            else:
                x = layer(x)
        return x

    def decode(
        self,
        ids_BT: torch.Tensor,
        cache: DecodeCache,
        doc_ids_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits_BTV, aux)`` of the next ``T`` tokens of every row, continuing ``cache`` (an empty
        ``DecodeCache`` starts a sequence: the prefill) and extending it by them. The logits equal those
        of one ``forward`` over the whole sequence so far at the same positions (tests/unit/test_decode.py).

        ``doc_ids_BT`` / ``positions_BT`` cover the new tokens only; unlike ``forward`` they may be given
        to a model built without ``document_mask`` (left padding: the padding is its own document).
        Positions default to continuing the cache (``seen .. seen + T - 1``)."""
        B, T = ids_BT.shape
        cache.check_step(B, doc_ids_BT)
        if positions_BT is None:
            positions_BT = (cache.seen + torch.arange(T, device=ids_BT.device)).expand(B, T)
        ctx = SeqContext(doc_ids_BT, positions_BT, cache)
        saved = dict(cache.tensors)  # a forward that fails leaves the cache as it was
        try:
            aux, state = self.embed.run(ids_BT, ctx)
            for block in self.blocks:
                aux, state = block.run(aux, ctx, state)
            out = self.head.run(aux, ctx, state)
        except BaseException:
            cache.tensors = saved
            cache.scratch.clear()
            raise
        cache.advance(doc_ids_BT, T)
        return out


def lm_loss(outputs: tuple[torch.Tensor, torch.Tensor], labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss = next-token CE + MoE aux, CE alone). ``labels`` are already shifted; -100 ignored."""
    logits_BTV, aux = outputs
    ce = F.cross_entropy(logits_BTV.float().reshape(-1, logits_BTV.shape[-1]), labels_BT.reshape(-1), ignore_index=-100)
    return ce + aux.float(), ce
