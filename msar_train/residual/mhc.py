"""Manifold-constrained Hyper-Connections (DeepSeek, arXiv 2512.24880).

State: ``(x_BTND,)`` -- N parallel residual streams per token (N = ``mhc_streams``), so a pipeline cut
carries N times the vanilla payload. Per branch, from ``x' = RMSNorm(flatten(x))``:
``Hpre = sigmoid(a_pre x'Wpre + b_pre)`` [N], ``Hpost = 2 sigmoid(a_post x'Wpost + b_post)`` [N],
``Hres = Sinkhorn(a_res mat(x'Wres) + b_res)`` [N,N] (doubly stochastic), and
``x <- Hres x + Hpost^T f(Hpre x)``.

Legend: B batch, T sequence, N streams, D d_model.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from msar_train.init_tags import tag_init
from msar_train.kernels import cpu_native
from msar_train.residual.base import Branch, ResidualBackend, ResidualSite, SeqContext, State, register


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn with a hand-written backward: each normalisation ``y = m / m.sum(dim)`` has the
    gradient ``dm = (dy - sum(dy * y, dim)) / m.sum(dim)``, four small ops instead of the ~7 autograd
    records for a division by a sum. It saves what autograd saved (each step's output and its sums,
    ``2 iters (n^2 + n)`` values per token) and no graph of ``4 iters`` nodes is recorded."""

    @staticmethod
    def forward(ctx, x_BTNN, iters: int):
        ctx.native = x_BTNN.shape[-1] <= 32 and x_BTNN.is_contiguous() and cpu_native.usable(x_BTNN)
        if ctx.native:  # the same steps in one pass per token; saves the same values
            y, sm, ss = cpu_native.sinkhorn_forward(x_BTNN, iters)
            ctx.save_for_backward(y, sm, ss)
            return y
        m = torch.exp(x_BTNN - x_BTNN.amax(dim=(-1, -2), keepdim=True))  # a global scale does not change the result
        saved = []
        for _ in range(iters):
            for dim in (-1, -2):  # rows, then columns
                s = m.sum(dim, keepdim=True)
                m = m / s
                saved += [m, s]
        ctx.save_for_backward(*saved)
        return m

    @staticmethod
    @once_differentiable  # a second backward would miss the saved steps' dependence on x: refused
    def backward(ctx, dy):
        if ctx.native:
            return cpu_native.sinkhorn_backward(*ctx.saved_tensors, dy), None
        saved = ctx.saved_tensors
        g = dy
        for k in range(len(saved) // 2 - 1, -1, -1):
            y, s = saved[2 * k], saved[2 * k + 1]
            dim = -1 if k % 2 == 0 else -2
            g = (g - (g * y).sum(dim, keepdim=True)) / s
        # through m0 = exp(x - max): dm0/dx = m0 with the max held fixed; the max itself gets no
        # gradient because the first normalisation makes the result independent of any global scale
        return g * (saved[0] * saved[1]), None  # m0 = y_0 * s_0


class _SumSq(torch.autograd.Function):
    """``sum(x^2)`` over the last dim (keepdim, accumulated and returned in at least fp32); its backward
    is one pass, ``2 g x``, where autograd through ``vector_norm`` takes three."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32)).square()

    @staticmethod
    def backward(ctx, g):  # built from the saved input itself, so it is differentiable again
        (x,) = ctx.saved_tensors
        return x * (2 * g).to(x.dtype)


class _PreMix(torch.autograd.Function):
    """Native ``Hpre x`` per token (kernels/cpu_native.py): one pass over the streams each way."""

    @staticmethod
    def forward(ctx, x_BTND, h_BTN):
        ctx.save_for_backward(x_BTND, h_BTN)
        return cpu_native.premix(x_BTND, h_BTN)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, h = ctx.saved_tensors
        return cpu_native.premix_backward(x, h, g.contiguous())


class _PostMix(torch.autograd.Function):
    """Native ``Hres x + Hpost f`` per token: one pass forward, one backward."""

    @staticmethod
    def forward(ctx, x_BTND, hres_BTNN, hpost_BTN, f_BTD):
        ctx.save_for_backward(x_BTND, hres_BTNN, hpost_BTN, f_BTD)
        return cpu_native.postmix(x_BTND, hres_BTNN, hpost_BTN, f_BTD)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return cpu_native.postmix_backward(*ctx.saved_tensors, g.contiguous())


def _native_mix(x_BTND: torch.Tensor, *more: torch.Tensor) -> bool:
    return x_BTND.is_contiguous() and all(t.is_contiguous() for t in more) and cpu_native.usable(x_BTND, *more)


def sinkhorn(logits_BTNN: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly-stochastic projection of exp(logits), in fp32 (exp underflow kills gradients in bf16)."""
    x = logits_BTNN.float()
    if iters < 1:
        return torch.exp(x - x.amax(dim=(-1, -2), keepdim=True))
    return _Sinkhorn.apply(x, iters)


@torch.no_grad()
def hres_diagnostics(h_res_BTNN: torch.Tensor) -> dict[str, torch.Tensor]:
    """mhc_ds_err []: per-token max |row or column sum - 1| of Hres (distance from doubly
    stochastic after the finite Sinkhorn), mean over tokens; mhc_hres [N, N]: mean Hres."""
    h = h_res_BTNN.float()
    dev = torch.maximum((h.sum(-1) - 1).abs().amax(-1), (h.sum(-2) - 1).abs().amax(-1))
    return {"mhc_ds_err": dev.mean(), "mhc_hres": h.mean((0, 1))}


class MHCSite(ResidualSite):
    def __init__(self, n: int, d_model: int, iters: int, scale_init: float, res_diag_init: float, eps: float, init_std: float):
        super().__init__()
        self.n, self.iters, self.eps = n, iters, eps
        nd = n * d_model
        self.w_pre = tag_init(nn.Parameter(torch.empty(nd, n)), "normal", init_std)
        self.w_post = tag_init(nn.Parameter(torch.empty(nd, n)), "normal", init_std)
        self.w_res = tag_init(nn.Parameter(torch.empty(nd, n * n)), "normal", init_std)
        self.a_pre = tag_init(nn.Parameter(torch.full((1,), float(scale_init))), "const", scale_init)
        self.a_post = tag_init(nn.Parameter(torch.full((1,), float(scale_init))), "const", scale_init)
        self.a_res = tag_init(nn.Parameter(torch.full((1,), float(scale_init))), "const", scale_init)
        # Hpre starts at 1/n (reads the stream mean), Hpost at 1 (writes f to every stream), Hres near
        # identity: with n equal copies of the embedding the first forward then equals vanilla's.
        pre0 = math.log(1.0 / (n - 1)) if n > 1 else 20.0  # logit(1/n)
        self.b_pre = tag_init(nn.Parameter(torch.full((n,), pre0)), "const", pre0)
        self.b_post = tag_init(nn.Parameter(torch.zeros(n)), "zeros")
        self.b_res = tag_init(nn.Parameter(torch.eye(n) * res_diag_init), "eye", res_diag_init)

    def maps(self, x_BTND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Hpre_BTN, Hpost_BTN, Hres_BTNN) for the current state.

        ``x' W = (x W) * rinv``: the RMS scale is per token, so it is applied to the ``2N + N^2`` logits
        instead of to the ``N*D`` inputs (x' is never formed), and the three maps are one product with
        the concatenated weights (the streams are read once, forward and backward)."""
        B, T, N, D = x_BTND.shape
        flat = x_BTND.reshape(B, T, N * D)
        sq = _SumSq.apply(flat)
        rinv = torch.rsqrt(sq / (N * D) + self.eps).to(flat.dtype)
        logits = (flat @ torch.cat([self.w_pre, self.w_post, self.w_res], 1).to(flat.dtype)) * rinv
        pre, post, res = logits.split([N, N, N * N], -1)
        h_pre = torch.sigmoid(self.a_pre * pre + self.b_pre)
        h_post = 2.0 * torch.sigmoid(self.a_post * post + self.b_post)
        h_res = sinkhorn(self.a_res * res.reshape(B, T, N, N) + self.b_res, self.iters)
        return h_pre, h_post, h_res

    def forward(self, state: State, branch: Branch, ctx: SeqContext) -> State:
        (x_BTND,) = state
        h_pre, h_post, h_res = self.maps(x_BTND)
        if self.recording:
            self.record(hres_diagnostics(h_res))
        dt = x_BTND.dtype
        hp, hr, hq = h_pre.to(dt).contiguous(), h_res.to(dt).contiguous(), h_post.to(dt).contiguous()
        if _native_mix(x_BTND, hp, hr, hq):  # CPU fp32/fp64: one pass per mix, no batched tiny matmuls
            f_BTD = branch(_PreMix.apply(x_BTND, hp))
            return (_PostMix.apply(x_BTND, hr, hq, f_BTD.contiguous()),)
        # Hpre x and Hres x as batched [N]-by-[N, D] products per token (no [B,T,N,D] product is formed);
        # Hpost^T f is added in place into Hres x (matmul saves its inputs, not its output).
        f_BTD = branch(torch.matmul(h_pre.to(dt).unsqueeze(-2), x_BTND).squeeze(-2))
        mixed = torch.matmul(h_res.to(dt), x_BTND)
        return (mixed.addcmul_(h_post.to(dt).unsqueeze(-1), f_BTD.unsqueeze(-2)),)


class _Entry(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, h_BTD: torch.Tensor) -> State:
        return (h_BTD.unsqueeze(-2).expand(*h_BTD.shape[:-1], self.n, h_BTD.shape[-1]).contiguous(),)


class _Exit(nn.Module):
    def forward(self, state: State, ctx: SeqContext) -> torch.Tensor:
        return state[0].mean(-2)  # mean of the streams (the final RMSNorm removes any scale)


@register
class MHCBackend(ResidualBackend):
    name = "mhc"

    def build_entry(self) -> nn.Module:
        return _Entry(self.cfg.mhc_streams)

    def build_site(self, layer_idx: int, sublayer: int) -> ResidualSite:
        c = self.cfg
        site = MHCSite(c.mhc_streams, self.d_model, c.sinkhorn_iters, c.mhc_scale_init, c.mhc_res_diag_init, self.norm_eps, self.init_std)
        site.target_index = self.branch_index(layer_idx, sublayer)  # Diagnosable: the spec's l
        return site

    def build_exit(self) -> nn.Module:
        return _Exit()

    def state_shapes(self, after_layer: int, batch: int, seq: int) -> list[tuple[int, ...]]:
        return [(batch, seq, self.cfg.mhc_streams, self.d_model)]

    def state_names(self, after_layer: int) -> list[str]:
        return ["streams"]

    def site_activation_bytes(self, layer_idx: int, sublayer: int, batch: int, seq: int, elem: int) -> int:
        """The new streams (n x D; the maps read the streams themselves, no normalised copy is formed),
        the pre-mixed branch input and the branch output (D each), the maps in fp32 (pre, post, their
        logits; Sinkhorn keeps each iteration's row and column sums and quotients: 2 iters (n^2 + n))."""
        n, d, iters = self.cfg.mhc_streams, self.d_model, self.cfg.sinkhorn_iters
        maps = 4 * (4 * n + 3 * n * n + 2 * iters * (n * n + n))
        return batch * seq * (elem * (n * d + 2 * d) + maps)

    def exit_activation_bytes(self, batch: int, seq: int, elem: int) -> int:
        return elem * batch * seq * self.d_model  # the stream mean

    def forward_flops_per_token(self) -> float:
        n, d, iters = self.cfg.mhc_streams, self.d_model, self.cfg.sinkhorn_iters
        # RMSNorm of n*d; the three maps (n*d -> 2n + n^2); Hres x and Hpost^T f (2 n^2 d + ...);
        # the pre-mix Hpre x (2 n d), adds; Sinkhorn: iters x (row + column normalisation) of n x n.
        per = 3 * n * d + 2 * n * d * (2 * n + n * n) + 2 * n * n * d + 4 * n * d + iters * 3 * n * n
        return float(self.n_branches * per)
