"""The pipeline-ready layers: ``EmbedLayer``, ``Block``, ``HeadLayer``.

Each layer maps a flat tuple of tensors (the *carry*) to the next carry, so a pipeline engine can cut
the list anywhere. Carry layout: ``(aux, [doc_ids_BT, positions_BT,] *state)`` where ``aux`` is the
running 0-dim MoE auxiliary loss, the optional int64 pair exists iff the model was built with
``document_mask``, and ``state`` is the residual backend's tuple.

Legend: B batch, T sequence, D d_model, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from msar_train.model.attention import Attention
from msar_train.model.ffn import SwiGLU
from msar_train.model.moe import MoE
from msar_train.model.norm import RMSNorm
from msar_train.residual.base import ResidualBackend, SeqContext, State

Carry = tuple[torch.Tensor, ...]


def pack(aux: torch.Tensor, ctx: SeqContext, state: State, document_mask: bool) -> Carry:
    extra = (ctx.doc_ids_BT, ctx.positions_BT) if document_mask else ()
    return (aux, *extra, *state)


def unpack(carry: Carry, document_mask: bool) -> tuple[torch.Tensor, SeqContext, State]:
    if document_mask:
        return carry[0], SeqContext(carry[1], carry[2]), tuple(carry[3:])
    return carry[0], SeqContext(), tuple(carry[1:])


class EmbedLayer(nn.Module):
    """ids_BT (or (ids_BT, doc_ids_BT, positions_BT) under document masking) -> carry."""

    def __init__(self, cfg, backend: ResidualBackend, document_mask: bool = False):
        super().__init__()
        self.document_mask = document_mask
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.entry = backend.build_entry()

    def forward(self, inputs) -> Carry:
        if self.document_mask:
            ids_BT, doc_ids_BT, positions_BT = inputs
            ctx = SeqContext(doc_ids_BT, positions_BT)
        else:
            ids_BT = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
            ctx = SeqContext()
        aux, state = self.run(ids_BT, ctx)
        return pack(aux, ctx, state, self.document_mask)

    def run(self, ids_BT: torch.Tensor, ctx: SeqContext) -> tuple[torch.Tensor, State]:
        """The layer without the carry: ``(aux, state)`` (``Transformer.decode`` folds over these)."""
        h_BTD = self.tok(ids_BT)
        # The running aux loss needs a grad_fn to cross a pipeline boundary, hence not a constant zero.
        aux = h_BTD.sum() * 0.0
        return aux, self.entry(h_BTD)


class Block(nn.Module):
    """One Transformer block: attention and FFN/MoE, each a residual branch with its own site."""

    def __init__(self, cfg, backend: ResidualBackend, layer_idx: int, document_mask: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.document_mask = document_mask
        head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim, cfg.rope_theta)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = layer_idx >= cfg.first_k_dense
        self.ffn = MoE(cfg.moe, cfg.d_model) if self.is_moe else SwiGLU(cfg.d_model, cfg.dense_hidden)
        self.attn_site = backend.build_site(layer_idx, 0)
        self.ffn_site = backend.build_site(layer_idx, 1)

    def forward(self, carry: Carry) -> Carry:
        aux, ctx, state = unpack(carry, self.document_mask)
        aux, state = self.run(aux, ctx, state)
        return pack(aux, ctx, state, self.document_mask)

    def run(self, aux: torch.Tensor, ctx: SeqContext, state: State) -> tuple[torch.Tensor, State]:
        state = self.attn_site(state, lambda h: self.attn(self.attn_norm(h), ctx), ctx)
        moe_aux: list[torch.Tensor] = []

        def ffn_branch(h_BTD: torch.Tensor) -> torch.Tensor:
            if not self.is_moe:
                return self.ffn(self.ffn_norm(h_BTD))
            y_BTD, a = self.ffn(self.ffn_norm(h_BTD))
            moe_aux.append(a)
            return y_BTD

        state = self.ffn_site(state, ffn_branch, ctx)
        for a in moe_aux:
            aux = aux + a.to(aux.dtype)
        return aux, state


class HeadLayer(nn.Module):
    """carry -> (logits_BTV, aux). With tied embeddings the output matrix is the embedding's."""

    def __init__(self, cfg, backend: ResidualBackend, document_mask: bool = False, tied: nn.Embedding | None = None):
        super().__init__()
        self.document_mask = document_mask
        self.exit = backend.build_exit()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Keep the tied embedding out of this module's registry (it is owned by EmbedLayer).
        self._tied = [tied] if tied is not None else []
        self.out = None if tied is not None else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, carry: Carry) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run(*unpack(carry, self.document_mask))

    def run(self, aux: torch.Tensor, ctx: SeqContext, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        h_BTD = self.norm(self.exit(state, ctx))
        weight_VD = self._tied[0].weight if self._tied else self.out.weight
        return h_BTD @ weight_VD.t(), aux
