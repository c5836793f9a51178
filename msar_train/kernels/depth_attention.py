"""Depth attention over residual sources, torch path (the reference every fast path is tested against).

Legend: S sources, M streams, B batch, T sequence, D d_model, K conv taps.

A *source* is one single-stream tensor ``s_BTD`` plus an ``expand`` callable that returns its M streams
stacked, ``E_MBTD`` (stream 0 is the identity), and their weightless-RMS-normalised keys ``khat_MBTD``
(see ``expand_keys``; callers may cache the pair per source, since every later target reads it).
For target ``l`` and stream ``r`` the logit of
source ``j`` is ``(q_r * g_r) . RMSNorm(E_r[s_j])`` (the key-norm weight g folded into the query) and
the output is ``z_r = sum_j softmax_j(logit) E_r[s_j]``.

Two-phase (exact): phase 1 reduces the completed sources to (unnormalised output o, running max mx,
sum of exponentials se) per stream; phase 2 merges the block's partial source with an online-softmax
update. ``direct`` is the plain one-softmax form used as the test reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim (the learnable weight is folded elsewhere)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def causal_depthwise_conv(x_BTD: torch.Tensor, w_KD: torch.Tensor, doc_ids_BT: torch.Tensor | None) -> torch.Tensor:
    """``y_t = sum_{delta<K} w[delta] * x_{t-delta}`` per channel, zero before the first token.

    With ``doc_ids_BT`` a tap never reaches into another document (the same policy as the attention
    mask), so packed documents do not leak into each other through the expansion.
    """
    # Shifted multiply-adds in [B, T, D] (on CPU ~4x faster than conv1d with its two transposes).
    K, T = w_KD.shape[0], x_BTD.shape[1]
    w = w_KD.to(x_BTD.dtype)
    y = x_BTD * w[0]
    for delta in range(1, min(K, T)):
        shifted = x_BTD[:, :-delta]
        if doc_ids_BT is not None:
            same_BT = doc_ids_BT[:, delta:] == doc_ids_BT[:, :-delta]
            shifted = shifted * same_BT.unsqueeze(-1).to(x_BTD.dtype)
        y[:, delta:].addcmul_(shifted, w[delta])
    return y


class Phase1(NamedTuple):
    o_MBTD: torch.Tensor  # unnormalised weighted sum, relative to mx
    mx_MBT: torch.Tensor  # running max of the logits
    se_MBT: torch.Tensor  # sum of exp(logit - mx)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def expand_keys(streams: list[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_MBTD, khat_MBTD) from a source's stream list; keys in the statistics dtype."""
    E_MBTD = torch.stack(streams)
    return E_MBTD, rms_normalize(E_MBTD.to(_stat_dtype(E_MBTD.dtype)), eps)


def _streams_and_logits(s_BTD: torch.Tensor, expand: Expand, qg_MD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    E_MBTD, khat_MBTD = expand(s_BTD)
    M, B, T, D = khat_MBTD.shape
    # One (B*T, D) @ (D, 1) product per stream: einsum would pick a bmm batched over tokens.
    logit = torch.bmm(khat_MBTD.reshape(M, B * T, D), qg_MD.to(khat_MBTD.dtype).unsqueeze(-1))
    return E_MBTD, logit.view(M, B, T)


def _weighted_sum(p_SMBT: torch.Tensor, Es: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_j p_j * E_j over sources, accumulated (no S-times stacked copy of the streams)."""
    out = None
    for p_MBT, E_MBTD in zip(p_SMBT, Es):
        term = p_MBT.unsqueeze(-1).to(E_MBTD.dtype) * E_MBTD
        out = term if out is None else out + term
    return out


def phase1(sources: Sequence[tuple[torch.Tensor, Expand]], qg_MD: torch.Tensor, eps: float) -> Phase1:
    """Reduce the completed sources of a block for one target (all streams at once)."""
    Es, logits = zip(*(_streams_and_logits(s, ex, qg_MD) for s, ex in sources))
    L_SMBT = torch.stack(logits)
    mx_MBT = L_SMBT.amax(0)
    p_SMBT = torch.exp(L_SMBT - mx_MBT)
    return Phase1(_weighted_sum(p_SMBT, Es), mx_MBT, p_SMBT.sum(0))


def phase2(p1: Phase1, partial: tuple[torch.Tensor, Expand] | None, qg_MD: torch.Tensor, eps: float) -> torch.Tensor:
    """Online-softmax merge of the partial source into phase 1's statistics; returns z_MBTD."""
    if partial is None:
        return p1.o_MBTD / p1.se_MBT.unsqueeze(-1).to(p1.o_MBTD.dtype)
    E2_MBTD, l2_MBT = _streams_and_logits(partial[0], partial[1], qg_MD)
    M = torch.maximum(p1.mx_MBT, l2_MBT)
    w1, w2 = torch.exp(p1.mx_MBT - M), torch.exp(l2_MBT - M)
    den = (w1 * p1.se_MBT + w2).unsqueeze(-1)
    dt = E2_MBTD.dtype
    return (w1.unsqueeze(-1).to(dt) * p1.o_MBTD + w2.unsqueeze(-1).to(dt) * E2_MBTD) / den.to(dt)


def two_phase(
    completed: Sequence[tuple[torch.Tensor, Expand]],
    partial: tuple[torch.Tensor, Expand] | None,
    qg_MD: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    return phase2(phase1(completed, qg_MD, eps), partial, qg_MD, eps)


def direct(sources: Sequence[tuple[torch.Tensor, Expand]], qg_MD: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over all sources: (z_MBTD, alpha_SMBT). Test reference and metrics path."""
    Es, logits = zip(*(_streams_and_logits(s, ex, qg_MD) for s, ex in sources))
    alpha_SMBT = torch.softmax(torch.stack(logits), dim=0)
    return _weighted_sum(alpha_SMBT, Es), alpha_SMBT
