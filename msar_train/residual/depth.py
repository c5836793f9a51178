"""Shared machinery of the depth-attention backends (Block/Full AttnRes and MSAR).

State carried between branches (and pipeline stages): ``(*completed, partial)`` or ``(*completed,)``
-- all single-stream ``[B,T,D]``. ``completed`` = ``[b_0, ..., b_{n-1}]`` (b_0 is the embedding
output); ``partial`` = ``b_n^{<l}``. Whether a partial is present is static (BlockLayout), so the
tuple's arity at every cut is known without running the model. Expanded streams are never stored in
the state: each target recomputes them from the single-stream summaries.

Legend: M streams, B batch, T sequence, D d_model, K conv taps.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from msar_train.init_tags import causal_mix_, tag_init
from msar_train.kernels import depth_attention as da
from msar_train.kernels.dispatch import DepthKernel
from msar_train.residual.base import Branch, Diagnosable, ResidualBackend, ResidualSite, SeqContext, State
from msar_train.residual.layout import BlockLayout


class SourceExpansion(nn.Module):
    """The M streams of one source j: identity plus causal depthwise convs whose weights belong to
    the *source* (shared by every target that reads it)."""

    def __init__(self, d_model: int, num_streams: int, kernel_sizes: list[int], conv: bool, smoothing: float = 0.1):
        super().__init__()
        self.num_streams = num_streams
        self.conv = conv
        self.weights = nn.ParameterList()
        if conv:
            for k in kernel_sizes:
                # Init (docs/decisions.md): (1 - s) * identity + s * causal moving average of width k,
                # s = residual.conv_init_smoothing; distinct widths give distinct keys at step 0.
                w = nn.Parameter(causal_mix_(torch.empty((k, d_model)), smoothing))
                self.weights.append(tag_init(w, "causal_mix", smoothing))

    def forward(self, s_BTD: torch.Tensor, doc_ids_BT: torch.Tensor | None) -> list[torch.Tensor]:
        if not self.conv:
            return [s_BTD] * self.num_streams
        return [s_BTD] + [da.causal_depthwise_conv(s_BTD, w, doc_ids_BT) for w in self.weights]


class DepthTarget(nn.Module):
    """Parameters and forward of one target l: per-stream pseudo-queries, key norms, and fusion."""

    def __init__(
        self,
        d_model: int,
        num_streams: int,
        fusion: str,
        fusion_scale_init: float,
        eps: float,
        init_std: float,
        single_source: bool = False,
        kernel=None,
    ):
        super().__init__()
        M = num_streams
        self.eps = eps
        # The model's DepthKernel (kernels/dispatch.py); None = the plain two-phase reference path.
        self.__dict__["_kernel"] = kernel
        # A target that only ever sees one source (branch 1 reads b_0 alone) has softmax weight 1
        # whatever its query: it gets no query/key-norm parameters, which could never learn.
        self.single_source = single_source
        if not single_source:
            self.query = tag_init(nn.Parameter(torch.zeros(M, d_model)), "zeros")  # zero-init: uniform weights
            self.key_norm = tag_init(nn.Parameter(torch.ones(M, d_model)), "ones")
        self.fusion = fusion
        if fusion == "adaptive":
            self.fusion_scale = tag_init(nn.Parameter(torch.full((1,), float(fusion_scale_init))), "const", fusion_scale_init)
            self.fusion_weight = tag_init(nn.Parameter(torch.empty(M * d_model, M)), "normal", init_std)
            self.fusion_bias = tag_init(nn.Parameter(torch.zeros(M)), "zeros")

    def qg(self) -> torch.Tensor:
        return self.query * self.key_norm  # q . (g * k_hat) == (q * g) . k_hat

    def fuse(self, z_MBTD: torch.Tensor) -> torch.Tensor:
        if self.fusion == "mean":
            return z_MBTD[0] if z_MBTD.shape[0] == 1 else z_MBTD.mean(0)
        M, B, T, D = z_MBTD.shape
        flat_BTX = z_MBTD.permute(1, 2, 0, 3).reshape(B, T, M * D)
        H_BTM = torch.sigmoid(self.fusion_scale * (da.rms_normalize(flat_BTX, self.eps) @ self.fusion_weight) + self.fusion_bias)
        return (H_BTM.permute(2, 0, 1).unsqueeze(-1).to(z_MBTD.dtype) * z_MBTD).sum(0)

    def fusion_weights(self, z_MBTD: torch.Tensor) -> torch.Tensor:
        """H per token (for metrics); mean fusion reports 1/M."""
        if self.fusion == "mean":
            M, B, T, _ = z_MBTD.shape
            return z_MBTD.new_full((B, T, M), 1.0 / M)
        M, B, T, D = z_MBTD.shape
        flat = da.rms_normalize(z_MBTD.permute(1, 2, 0, 3).reshape(B, T, M * D), self.eps)
        return torch.sigmoid(self.fusion_scale * (flat @ self.fusion_weight) + self.fusion_bias)

    def forward(self, completed, partial, ctx: SeqContext) -> torch.Tensor:
        kernel = self.__dict__.get("_kernel")
        if kernel is not None:
            return kernel.forward(self, [s for s, _ in completed], None if partial is None else partial[0], ctx.doc_ids_BT)
        return self.reference(completed, partial)

    def reference(self, completed, partial) -> torch.Tensor:
        """The plain two-phase path over (tensor, expand) sources, whatever the model's kernel."""
        if self.single_source:
            ((s_BTD, expand),) = completed
            return self.fuse(expand(s_BTD)[0])
        return self.fuse(da.two_phase(completed, partial, self.qg(), self.eps))


class DepthBackend(ResidualBackend):
    """Block/Full depth attention; subclasses fix the stream setup."""

    num_streams: int
    kernel_sizes: list[int]
    fusion: str
    conv: bool

    def __init__(self, cfg, n_layers: int, d_model: int, norm_eps: float, init_std: float):
        super().__init__(cfg, n_layers, d_model, norm_eps, init_std)
        n_blocks = self.n_branches if cfg.n_blocks is None else cfg.n_blocks
        self.layout = BlockLayout(self.n_branches, n_blocks)
        # Source j's expansion is shared by every target reading it; built once per process.
        self._banks: dict[int, SourceExpansion] = {}
        # Block n's targets with queries built in this process, in branch order (their phase 1 is batched).
        self._peers: dict[int, list[DepthTarget]] = {}
        self.kernel = DepthKernel(getattr(cfg, "kernel", "torch"), self.num_streams, self.bank)

    def bank(self, j: int) -> SourceExpansion:
        if j not in self._banks:
            smoothing = getattr(self.cfg, "conv_init_smoothing", 0.1)
            self._banks[j] = SourceExpansion(self.d_model, self.num_streams, self.kernel_sizes, self.conv, smoothing)
        return self._banks[j]

    @property
    def conv_reach(self) -> int:
        """How many earlier positions of a source its expansion reads (max(kernel_sizes) - 1; 0 without convs)."""
        return max(self.kernel_sizes) - 1 if self.conv and self.kernel_sizes else 0

    def is_cut_point(self, after_layer: int) -> bool:
        return not self.layout.state_after(2 * after_layer)[1]

    def shared_modules(self) -> dict[str, nn.Module]:
        return {f"source{j}": bank for j, bank in sorted(self._banks.items())}

    def _target(self, single_source: bool = False) -> DepthTarget:
        scale = getattr(self.cfg, "fusion_scale_init", 0.01)
        return DepthTarget(self.d_model, self.num_streams, self.fusion, scale, self.norm_eps, self.init_std, single_source, self.kernel)

    def build_entry(self) -> nn.Module:
        return _Entry()

    def build_site(self, layer_idx: int, sublayer: int) -> ResidualSite:
        return DepthSite(self, self.branch_index(layer_idx, sublayer))

    def build_exit(self) -> nn.Module:
        return DepthExit(self)

    def state_shapes(self, after_layer: int, batch: int, seq: int) -> list[tuple[int, ...]]:
        n_completed, has_partial = self.layout.state_after(2 * after_layer)
        return [(batch, seq, self.d_model)] * (n_completed + int(has_partial))

    def state_names(self, after_layer: int) -> list[str]:
        n_completed, has_partial = self.layout.state_after(2 * after_layer)
        return [f"b_{j}" for j in range(n_completed)] + ([f"partial_b_{n_completed}"] if has_partial else [])

    # Memory of the default lean path (kernels/lean.py, residual.kernel torch | compile), counted from
    # its code; the Triton kernels save the same per target. N = batch * seq, C = M - 1 conv streams.
    def _conv_streams(self) -> int:
        return self.num_streams - 1 if self.conv else 0

    def site_activation_bytes(self, layer_idx: int, sublayer: int, batch: int, seq: int, elem: int) -> int:
        """Kept per target: its output (the branch input) and the new partial / summary (D each), the
        fp32 softmax statistic ``lse`` (M per token) and, for a new source, its streams' fp32 inverse
        RMS (M per token). Nothing of size M x D: the backward recomputes the streams."""
        M = self.num_streams
        return batch * seq * (elem * 2 * self.d_model + 4 * 2 * M)

    def exit_activation_bytes(self, batch: int, seq: int, elem: int) -> int:
        return batch * seq * (elem * self.d_model + 4 * self.num_streams)

    def site_backward_bytes(self, layer_idx: int, sublayer: int, batch: int, seq: int, elem: int, checkpointed: bool) -> int:
        """A target's backward recomputes its sources' conv streams and forms, one source at a time,
        the M stream gradients, next to the recomputed mixture z and its gradient (M x D each).
        Shared (no checkpointing): the streams of every completed source and their summed gradient
        (C x D each) stay from the first reader's backward (the exit) to the source's sink, so a
        target in block n sees those of b_0 .. b_{n-1}; its partial's streams are its own.
        Checkpointed: each target expands all its S sources itself and drops them after."""
        lay, M, C, D, N = self.layout, self.num_streams, self._conv_streams(), self.d_model, batch * seq
        if layer_idx >= self.n_branches // 2:  # the exit
            completed, partial = lay.n_blocks + 1, 0
        else:
            branch = self.branch_index(layer_idx, sublayer)
            completed, partial = lay.block_of(branch), int(not lay.is_first(branch))
        S = completed + partial
        stats = 4 * 3 * S * M * N  # logits, weights and inverse RMS of every (source, stream)
        if checkpointed:
            return elem * N * D * (S * C + 3 * M) + stats
        return elem * N * D * (2 * C * completed + partial * C + 3 * M) + stats

    def forward_flops_per_token(self) -> float:
        """Expansions (convs + key RMS) once per source, then per target and stream the logits, the
        weighted sum and the softmax over its sources, and the adaptive fusion."""
        d, M, L, lay = self.d_model, self.num_streams, self.n_branches, self.layout
        taps = sum(self.kernel_sizes) if self.conv else 0
        n_sources = lay.n_blocks + 1 + sum(1 for b in range(1, L + 1) if not lay.is_first(b))
        flops = n_sources * (2 * taps * d + 3 * M * d)
        for tgt in range(1, L + 2):
            S = lay.n_blocks + 1 if tgt == L + 1 else lay.block_of(tgt) + int(not lay.is_first(tgt))
            flops += M * S * (2 * d + 2 * d + 5)
            if self.fusion == "adaptive":
                flops += 3 * M * d + 2 * M * d * M + 2 * M * d
        return float(flops)


class _Entry(nn.Module):
    def forward(self, h_BTD: torch.Tensor) -> State:
        return (h_BTD,)  # b_0


def expanded(bank: SourceExpansion, s_BTD: torch.Tensor, doc_ids_BT: torch.Tensor | None, eps: float):
    """(E_MBTD, khat_MBTD) of one source, memoised on the source tensor itself.

    Every later target of the forward reads the same source, so its expansion is computed once per
    forward instead of once per target. The memo lives exactly as long as the tensor (a recomputed
    forward, e.g. under activation checkpointing, creates new tensors and recomputes)."""
    memo = s_BTD.__dict__.setdefault("_msar_expanded", {})
    # Any in-place change of the source or of the conv weights (an optimizer step) invalidates.
    stamp = (doc_ids_BT, s_BTD._version, tuple(w._version for w in bank.weights))
    hit = memo.get(id(bank))
    if hit is None or hit[0][0] is not doc_ids_BT or hit[0][1:] != stamp[1:]:
        hit = (stamp, da.expand_keys(bank(s_BTD, doc_ids_BT), eps))
        memo[id(bank)] = hit
    return hit[1]


def _expander(bank: SourceExpansion, ctx: SeqContext, eps: float):
    return lambda s_BTD: expanded(bank, s_BTD, ctx.doc_ids_BT, eps)


# Incremental decoding (SeqContext.cache; model/cache.py). The only thing a depth target reads from
# other positions is its sources' causal convolutions, which reach back ``width = max(kernel_sizes) - 1``
# positions. So each source keeps its last ``width`` positions in the cache; a decoding forward
# computes the convolutions at the new positions only, from the window ``cat(history, new)`` (exact: a
# window holds every position they read; a shorter history is the sequence start, where the
# convolution pads with zeros anyway), then runs the two-phase reference math on the new positions.
# Cost per new token: K taps per stream and source plus the per-token depth softmax, whatever the
# sequence's length, and whatever ``residual.kernel`` (the kernels are for [B, T, D] training shapes).


def decode_window(cache, key, s_BTD: torch.Tensor, width: int) -> torch.Tensor:
    """``cat(history, s_BTD)`` of source ``key``; built once per forward (memo on the tensor, which every
    target reading the source shares), filing the window's last ``width`` positions as the new history."""
    w = s_BTD.__dict__.get("_msar_window")
    if w is None:
        hist = cache.tensors.get(("msar_source", key))
        w = s_BTD if hist is None else torch.cat([hist, s_BTD], 1)
        cache.tensors[("msar_source", key)] = w[:, -width:]
        s_BTD.__dict__["_msar_window"] = w
    return w


def _window_doc(ctx: SeqContext, hist_len: int) -> torch.Tensor | None:
    """Document ids of a decoding window with ``hist_len`` earlier positions (None without doc ids)."""
    doc = ctx.doc_ids_BT
    if doc is None or not hist_len:
        return doc
    key = ("msar_window_doc", hist_len)
    if key not in ctx.cache.scratch:
        ctx.cache.scratch[key] = torch.cat([ctx.cache.doc_ids_BT[:, -hist_len:], doc], 1)
    return ctx.cache.scratch[key]


def decode_streams(bank: SourceExpansion, win_BWD: torch.Tensor, doc_BW: torch.Tensor | None, n_new: int) -> list[torch.Tensor]:
    """The M streams of a source at the last ``n_new`` positions of its window: each conv as one
    gather of the K_max positions each new token reads (zeroed before the start and across documents)
    and a K-tap weighted sum."""
    new_BTD = win_BWD[:, -n_new:]
    if not bank.conv:
        return [new_BTD] * bank.num_streams
    W, dev = win_BWD.shape[1], win_BWD.device
    K = max(w.shape[0] for w in bank.weights)
    t_T = torch.arange(W - n_new, W, device=dev)
    idx_TK = t_T.unsqueeze(1) - torch.arange(K, device=dev)  # position read by tap delta
    valid = (idx_TK >= 0).unsqueeze(0)  # 1,T,K
    idx_TK = idx_TK.clamp_min(0)
    if doc_BW is not None:
        valid = valid & (doc_BW[:, idx_TK] == doc_BW[:, t_T].unsqueeze(-1))  # B,T,K
    g_BTKD = win_BWD[:, idx_TK] * valid.unsqueeze(-1).to(win_BWD.dtype)
    return [new_BTD] + [(g_BTKD[:, :, : w.shape[0]] * w.to(win_BWD.dtype)).sum(2) for w in bank.weights]


def _decode_expander(bank: SourceExpansion, ctx: SeqContext, key, width: int, eps: float):
    def expand(s_BTD: torch.Tensor):
        hit = s_BTD.__dict__.get("_msar_decoded")
        if hit is None:
            win = decode_window(ctx.cache, key, s_BTD, width)
            n = s_BTD.shape[1]
            streams = decode_streams(bank, win, _window_doc(ctx, win.shape[1] - n), n)
            hit = s_BTD.__dict__["_msar_decoded"] = da.expand_keys(streams, eps)
        return hit

    return expand


def _read_sources(banks, completed, partial, partial_key, ctx: SeqContext, width: int, eps: float):
    """``(srcs, psrc, decoding)``: the (tensor, expand) pairs a target reads. ``decoding``: the expansions
    are those of the new positions from the cache's history (run the reference math on them)."""
    if ctx.cache is not None and width:
        srcs = [(s, _decode_expander(banks[j], ctx, ("b", j), width, eps)) for j, s in enumerate(completed)]
        psrc = None if partial is None else (partial, _decode_expander(banks[len(completed)], ctx, partial_key, width, eps))
        return srcs, psrc, True
    srcs = [(s, _expander(banks[j], ctx, eps)) for j, s in enumerate(completed)]
    psrc = None if partial is None else (partial, _expander(banks[len(completed)], ctx, eps))
    return srcs, psrc, False


@torch.no_grad()
def depth_diagnostics(target: DepthTarget, sources) -> dict[str, torch.Tensor]:
    """What one target's forward looks like (recording only; recomputed with the one-softmax
    ``direct`` path, so the training path stays untouched). ``sources`` = ``[b_0, ..., (partial)]``
    as (tensor, expand) pairs: source ``j`` is ``b_j`` (the partial uses its block's index ``n``).

    depth_alpha [S, M]: softmax weights over sources per stream, mean over batch and tokens;
    depth_entropy [M]: per-token entropy of those weights over log(S) (1 = uniform; 0 when S = 1);
    fusion_weights [M]: the fusion gates H (1/M under mean fusion), mean over batch and tokens.
    """
    if target.single_source:
        ((s_BTD, expand),) = sources
        z_MBTD = expand(s_BTD)[0]
        M = z_MBTD.shape[0]
        alpha_SM = z_MBTD.new_ones(1, M, dtype=torch.float32)
        entropy_M = z_MBTD.new_zeros(M, dtype=torch.float32)
    else:
        z_MBTD, alpha_SMBT = da.direct(sources, target.qg(), target.eps)
        alpha_SMBT = alpha_SMBT.float()
        alpha_SM = alpha_SMBT.mean((2, 3))
        S = alpha_SMBT.shape[0]
        ent_MBT = -(alpha_SMBT * alpha_SMBT.clamp_min(1e-30).log()).sum(0)
        entropy_M = ent_MBT.mean((1, 2)) / math.log(S) if S > 1 else torch.zeros_like(ent_MBT[:, 0, 0])
    fusion_M = target.fusion_weights(z_MBTD).float().mean((0, 1))
    return {"depth_alpha": alpha_SM, "depth_entropy": entropy_M, "fusion_weights": fusion_M}


class DepthSite(ResidualSite):
    def __init__(self, backend: DepthBackend, branch: int):
        super().__init__()
        lay = backend.layout
        self.branch = branch
        self.target_index = branch  # Diagnosable: the spec's l
        self.block = lay.block_of(branch)  # n
        self.has_partial = not lay.is_first(branch)
        self.target = backend._target(single_source=self.block == 1 and not self.has_partial)
        if not self.target.single_source:
            peers = backend._peers.setdefault(self.block, [])
            peers.append(self.target)
            self.target.__dict__["_peers"] = peers
        # Sources b_0..b_{n-1} plus the partial of block n (which uses source n's expansion).
        self.banks = nn.ModuleList([backend.bank(j) for j in range(self.block + 1)])
        self.width = backend.conv_reach

    def forward(self, state: State, branch: Branch, ctx: SeqContext) -> State:
        completed = state[: self.block]
        partial = state[self.block] if self.has_partial else None
        assert len(state) == self.block + int(self.has_partial), "state arity does not match the block layout"
        srcs, psrc, decoding = _read_sources(self.banks, completed, partial, ("p", self.branch), ctx, self.width, self.target.eps)
        h_BTD = self.target.reference(srcs, psrc) if decoding else self.target(srcs, psrc, ctx)
        if self.recording:
            self.record(depth_diagnostics(self.target, srcs if psrc is None else [*srcs, psrc]))
        v_BTD = branch(h_BTD)
        # When this branch ends its block the partial becomes the completed summary b_n: same tuple.
        return (*completed, v_BTD if partial is None else partial + v_BTD)


class DepthExit(Diagnosable, nn.Module):
    """Output aggregation: target L+1 attends over all completed summaries b_0..b_N."""

    def __init__(self, backend: DepthBackend):
        super().__init__()
        self.target_index = backend.n_branches + 1  # Diagnosable: l = L + 1
        self.n_sources = backend.layout.n_blocks + 1
        self.target = backend._target()
        self.target.__dict__["_peers"] = [self.target]  # the exit is a block of its own
        self.banks = nn.ModuleList([backend.bank(j) for j in range(self.n_sources)])
        self.width = backend.conv_reach

    def forward(self, state: State, ctx: SeqContext) -> torch.Tensor:
        assert len(state) == self.n_sources
        srcs, _, decoding = _read_sources(self.banks, state, None, None, ctx, self.width, self.target.eps)
        if self.recording:
            self.record(depth_diagnostics(self.target, srcs))
        return self.target.reference(srcs, None) if decoding else self.target(srcs, None, ctx)


__all__ = ["DepthBackend", "DepthExit", "DepthSite", "DepthTarget", "SourceExpansion"]
