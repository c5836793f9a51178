"""DeepSeekMoE / DeepSeek-V3 style mixture-of-experts FFN with dropless dispatch.

Legend:
    B = batch, T = sequence length, N = B*T tokens, D = d_model,
    E = n_routed experts, K = top_k, G = n_group, P = experts per group (E // G),
    S = sequences a balance loss averages over, L = tokens per such sequence (S*L = N),
    M = N*K (token, slot) pairs.

Routing: scores (softmax or sigmoid of ``x @ W^T``) are computed in float32 (float64 for float64
inputs) because bf16 logits make top-k selection noisy. Selection uses ``scores + expert_bias``;
the bias exists only to steer *which* experts are chosen (auxiliary-loss-free balancing), so the
mixing weights always come from the unbiased scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from msar_train.config.schema import MoEConfig
from msar_train.model.ffn import SwiGLU
from msar_train.model.recompute import recomputing

_SCORE_FUNCS = ("softmax", "sigmoid")
# Counters/biases must not be rounded away when the model is cast to bf16/fp16.
_KEEP_DTYPES = (torch.float32, torch.float64)


@dataclass
class RouterOutput:
    idx_NK: torch.Tensor  # long: chosen experts per token
    # weight_NK / scores_NE are float32 (float64 for fp64 input) and never include the bias.
    weight_NK: torch.Tensor  # mixing weights of the chosen experts
    scores_NE: torch.Tensor  # scores of all experts
    aux_loss: torch.Tensor  # 0-dim: expert-level + sequence-wise balance losses


def balance_loss(probs_SLE: torch.Tensor, idx_SLK: torch.Tensor) -> torch.Tensor:
    """``mean_s sum_i f_{s,i} P_{s,i}`` with ``f = E/(K*L) * count`` and ``P = mean_t probs``.

    ``f`` is 1 for every expert under perfectly uniform routing, so the loss is then exactly
    ``sum_i P_i = 1``. Counts are non-differentiable; the gradient flows through ``P`` only.
    """
    S, L, E = probs_SLE.shape
    K = idx_SLK.shape[-1]
    counts_SE = torch.zeros(S, E, dtype=probs_SLE.dtype, device=probs_SLE.device)
    counts_SE.scatter_add_(1, idx_SLK.reshape(S, L * K), counts_SE.new_ones(S, L * K))
    f_SE = counts_SE * (E / (K * L))
    P_SE = probs_SLE.mean(dim=1)
    return (f_SE * P_SE).sum(dim=-1).mean()


def _keep_float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in _KEEP_DTYPES else t.float()


class Router(nn.Module):
    """Top-k gate with optional group-limited routing and balance losses."""

    def __init__(self, cfg: MoEConfig, d_model: int) -> None:
        super().__init__()
        E, G = cfg.n_routed, cfg.n_group
        if cfg.score_func not in _SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {_SCORE_FUNCS}, got {cfg.score_func!r}")
        if not 1 <= cfg.top_k <= E:
            raise ValueError(f"top_k={cfg.top_k} must lie in [1, n_routed={E}]")
        if G < 1 or E % G != 0:
            raise ValueError(f"n_group={G} must be >= 1 and divide n_routed={E}")
        if G > 1 and not 1 <= cfg.topk_group <= G:
            raise ValueError(f"topk_group={cfg.topk_group} must lie in [1, n_group={G}]")
        if G > 1 and cfg.top_k > cfg.topk_group * (E // G):
            raise ValueError("top_k exceeds the experts available in the kept groups")
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(E, d_model))
        nn.init.normal_(self.weight, std=d_model**-0.5)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)

    def _apply(self, fn: Callable, recurse: bool = True) -> Router:
        super()._apply(fn, recurse)
        self.expert_bias = _keep_float(self.expert_bias)
        return self

    def _mask_groups(self, biased_NE: torch.Tensor) -> torch.Tensor:
        """Set every expert outside the ``topk_group`` best groups to -inf."""
        cfg = self.cfg
        N, E = biased_NE.shape
        P = E // cfg.n_group
        biased_NGP = biased_NE.view(N, cfg.n_group, P)
        if cfg.score_func == "sigmoid":
            # DeepSeek-V3: a group is as good as its two best experts (less noisy than the max).
            group_NG = biased_NGP.topk(min(2, P), dim=-1).values.sum(dim=-1)
        else:
            group_NG = biased_NGP.amax(dim=-1)
        keep_NG = torch.zeros_like(group_NG, dtype=torch.bool)
        keep_NG.scatter_(1, group_NG.topk(cfg.topk_group, dim=-1).indices, True)
        return biased_NGP.masked_fill(~keep_NG[:, :, None], float("-inf")).view(N, E)

    def _aux_loss(self, scores_NE: torch.Tensor, idx_NK: torch.Tensor, seq_len: int) -> torch.Tensor:
        cfg = self.cfg
        N, E = scores_NE.shape
        K = idx_NK.shape[-1]
        if cfg.aux_loss_coef == 0 and cfg.seq_aux_loss_coef == 0:
            # Keep a (zero) graph edge so callers may always backprop / all-reduce it.
            return scores_NE.sum() * 0.0
        probs_NE = scores_NE
        if cfg.score_func == "sigmoid":
            # Sigmoid scores are not a distribution; P_i must be a share of the token's mass.
            probs_NE = scores_NE / (scores_NE.sum(dim=-1, keepdim=True) + 1e-20)
        loss = scores_NE.new_zeros(())
        if cfg.aux_loss_coef != 0:
            loss = loss + cfg.aux_loss_coef * balance_loss(probs_NE.view(1, N, E), idx_NK.view(1, N, K))
        if cfg.seq_aux_loss_coef != 0:
            if N % seq_len != 0:
                raise ValueError(f"{N} tokens do not split into sequences of length {seq_len}")
            S = N // seq_len
            loss = loss + cfg.seq_aux_loss_coef * balance_loss(probs_NE.view(S, seq_len, E), idx_NK.view(S, seq_len, K))
        return loss

    def forward(self, x_ND: torch.Tensor, seq_len: int | None = None) -> RouterOutput:
        """Route N tokens; ``seq_len`` (T) splits them into sequences for the sequence-wise loss
        (default: all N tokens form one sequence)."""
        cfg = self.cfg
        route_dtype = torch.float64 if x_ND.dtype == torch.float64 else torch.float32
        logits_NE = x_ND.to(route_dtype) @ self.weight.to(route_dtype).t()
        if cfg.score_func == "softmax":
            scores_NE = logits_NE.softmax(dim=-1)
        else:
            scores_NE = logits_NE.sigmoid()

        # Selection is a discrete choice: no gradient, and the bias only shifts the ranking.
        with torch.no_grad():
            biased_NE = scores_NE.detach() + self.expert_bias.to(route_dtype)
            if cfg.n_group > 1:
                biased_NE = self._mask_groups(biased_NE)
            idx_NK = biased_NE.topk(cfg.top_k, dim=-1).indices

        weight_NK = scores_NE.gather(1, idx_NK)
        if cfg.norm_topk_prob:
            weight_NK = weight_NK / (weight_NK.sum(dim=-1, keepdim=True) + 1e-20)
        weight_NK = weight_NK * cfg.routed_scaling_factor

        aux = self._aux_loss(scores_NE, idx_NK, seq_len if seq_len is not None else x_ND.shape[0])
        return RouterOutput(idx_NK=idx_NK, weight_NK=weight_NK, scores_NE=scores_NE, aux_loss=aux)


class MoE(nn.Module):
    """Shared experts + top-k routed experts, dropless (no capacity factor, no token dropping)."""

    def __init__(self, cfg: MoEConfig, d_model: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, d_model)
        self.experts = nn.ModuleList(SwiGLU(d_model, cfg.expert_hidden) for _ in range(cfg.n_routed))
        # n_shared always-on experts fused into one wider SwiGLU: the hidden units of separate
        # experts are independent, so concatenating them and summing in w_down is identical.
        self.shared: SwiGLU | None = SwiGLU(d_model, cfg.expert_hidden * cfg.n_shared) if cfg.n_shared > 0 else None
        # Selected-token counts since the last consume_load(); not checkpointed (transient).
        self.register_buffer(
            "load_counts",
            torch.zeros(cfg.n_routed, dtype=torch.float32),
            persistent=False,
        )
        self.last_load: torch.Tensor | None = None

    def _apply(self, fn: Callable, recurse: bool = True) -> MoE:
        super()._apply(fn, recurse)
        self.load_counts = _keep_float(self.load_counts)
        return self

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x_BTD.shape
        N, K, E = B * T, self.cfg.top_k, self.cfg.n_routed
        x_ND = x_BTD.reshape(N, D)
        r = self.router(x_ND, seq_len=T)

        # Sort the M = N*K (token, slot) pairs by expert so each expert sees one contiguous slice
        # and runs exactly once; stable sort keeps token order inside a slice (deterministic).
        expert_M = r.idx_NK.reshape(-1)
        order_M = torch.argsort(expert_M, stable=True)
        token_M = order_M // K
        counts_E = torch.bincount(expert_M, minlength=E)
        x_MD = x_ND[token_M]
        w_M = r.weight_NK.reshape(-1)[order_M]

        # One host sync per layer to learn the slice sizes. Every expert runs, also on zero rows: each
        # expert parameter then gets a gradient (zeros) on every data-parallel rank, so hook-driven
        # gradient reductions (ZeRO-2 buckets) see the same parameters in the same order everywhere.
        # torch.split, not one slice per expert: a slice's backward fills a zero tensor of the whole
        # [M, D] input per expert (E full-size fills and adds per layer); split's backward is one cat.
        x_parts = torch.split(x_MD, counts_E.tolist(), dim=0)
        y_MD = torch.cat([expert(x) for expert, x in zip(self.experts, x_parts, strict=True)], dim=0)
        # Weighting in the routing precision, then back to the activation dtype.
        y_MD = (y_MD.to(w_M.dtype) * w_M[:, None]).to(x_ND.dtype)
        out_ND = torch.zeros_like(x_ND).index_add_(0, token_M, y_MD)
        if self.shared is not None:
            out_ND = out_ND + self.shared(x_ND).to(x_ND.dtype)

        load_E = counts_E.detach().to(torch.float32)
        self.last_load = load_E
        if self.training and not recomputing():  # an activation-checkpoint recompute is not a new forward
            self.load_counts += load_E.to(self.load_counts.dtype)
        return out_ND.view(B, T, D), r.aux_loss

    @torch.no_grad()
    def consume_load(self) -> torch.Tensor:
        """Return the counts accumulated since the last call (over micro-batches) and reset them."""
        counts_E = self.load_counts.clone()
        self.load_counts.zero_()
        return counts_E

    @torch.no_grad()
    def apply_bias_update(self, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the selection bias of under-loaded experts, lower it for
        over-loaded ones. ``counts_E`` may already be all-reduced over data-parallel ranks."""
        if not self.cfg.bias_update:
            return
        bias_E = self.router.expert_bias
        counts_E = counts_E.to(device=bias_E.device, dtype=torch.float64)
        if counts_E.sum() <= 0:
            return
        bias_E += (self.cfg.bias_update_rate * torch.sign(counts_E.mean() - counts_E)).to(bias_E.dtype)
