"""Causal self-attention with RoPE and grouped-query attention, via ``scaled_dot_product_attention``.

Legend: B batch, T sequence, D d_model, H query heads, G kv heads, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from msar_train.residual.base import SeqContext


def rope(x_BHTE: torch.Tensor, positions_BT: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention), angles computed in fp32 from explicit positions so
    that positions may restart per packed document."""
    E = x_BHTE.shape[-1]
    inv_freq = theta ** (-torch.arange(0, E, 2, device=x_BHTE.device, dtype=torch.float32) / E)
    ang_BTF = positions_BT.float().unsqueeze(-1) * inv_freq
    cos, sin = ang_BTF.cos().unsqueeze(1), ang_BTF.sin().unsqueeze(1)  # B,1,T,E/2
    x1, x2 = x_BHTE.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BHTE.dtype)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, rope_theta: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_theta = n_heads, n_kv_heads, head_dim, rope_theta
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        pos = ctx.positions_BT
        if pos is None:
            pos = torch.arange(T, device=x_BTD.device).expand(B, T)
        q, k = rope(q, pos, self.rope_theta), rope(k, pos, self.rope_theta)
        gqa = self.n_kv_heads != self.n_heads
        if ctx.cache is not None:
            o = self._attend_cached(q, k, v, ctx)
        elif ctx.doc_ids_BT is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            causal_TT = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril()
            same_BTT = ctx.doc_ids_BT.unsqueeze(-1) == ctx.doc_ids_BT.unsqueeze(-2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=(causal_TT & same_BTT).unsqueeze(1), enable_gqa=gqa)
        return self.wo(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """Incremental decoding: the new queries attend over the cached keys/values and their own;
        query ``t`` (absolute ``seen + t``) sees keys ``<= seen + t`` of its own document."""
        cache = ctx.cache
        T, past = q.shape[2], cache.seen
        old_k, old_v = cache.tensors.get((self, "k")), cache.tensors.get((self, "v"))
        if old_k is not None:
            k, v = torch.cat([old_k, k], 2), torch.cat([old_v, v], 2)
        cache.tensors[(self, "k")], cache.tensors[(self, "v")] = k, v
        S = k.shape[2]
        mask = torch.arange(S, device=q.device) <= past + torch.arange(T, device=q.device).unsqueeze(-1)  # T,S
        if ctx.doc_ids_BT is not None:
            doc_S = ctx.doc_ids_BT if cache.doc_ids_BT is None else torch.cat([cache.doc_ids_BT, ctx.doc_ids_BT], 1)
            mask = mask & (ctx.doc_ids_BT.unsqueeze(-1) == doc_S.unsqueeze(-2))  # B,T,S
            mask = mask.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads)
