"""Memory-lean torch path of one depth-attention target (``residual.kernel: torch | compile``).

Legend: S sources, M streams, C conv streams (M - 1, or 0), B batch, T sequence, D d_model, K taps.

What autograd keeps per target: the single-stream sources (already alive: they are the residual
state), the target's parameters and the softmax statistic ``lse_MBT``. Nothing of size M*B*T*D is
saved; the backward recomputes the weighted sum and the fusion from the sources.

Expansions are shared between the targets that read one source through a :class:`SourceEntry`
kept in the model's :class:`Runtime` (keyed by source tensor and expansion bank):

* forward: the entry computes the conv streams ``Ec_CBTD`` and their inverse RMS once, every later
  target reuses them. ``Runtime.after_read`` drops them once the last local reader has run (the
  reader count is learnt on the first forward), so they are not held through the backward.
* backward: the first reader recomputes them (kept until the sink below has run); each reader
  forms its stream gradients one source at a time and adds the conv streams' part into
  ``entry.dEc_CBTD``; one
  :class:`_ExpandNode` per source (an input of every reader, so autograd runs it after all of
  them) turns that sum into the source's and the conv weights' gradients with a single transposed
  conv. The identity stream's gradient goes straight to the source.

The partial source of a block is read by one target only: its expansion is recomputed and
backpropagated inside that target.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from msar_train.kernels import cpu_native
from msar_train.kernels.depth_attention import causal_depthwise_conv


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def conv_streams(s_BTD: torch.Tensor, weights: list[torch.Tensor], doc_ids_BT: torch.Tensor | None) -> torch.Tensor:
    """``Ec_CBTD``: the conv streams r >= 1 of one source (no identity stream)."""
    return torch.stack([causal_depthwise_conv(s_BTD, w, doc_ids_BT) for w in weights])


def conv_streams_backward(
    s_BTD: torch.Tensor, weights: list[torch.Tensor], doc_ids_BT: torch.Tensor | None, dEc_CBTD: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(ds_BTD, [dw_KD per conv stream]) of ``conv_streams`` given the streams' gradient: the transposed
    conv as shifted multiply-adds (``ds[t - delta] += w[delta] * dE[t]``, ``dw[delta] = sum dE[t] s[t - delta]``,
    document-masked like the forward); on CPU ~10x faster than ``aten.convolution_backward``."""
    if cpu_native.conv_usable(s_BTD, weights, dEc_CBTD):
        return cpu_native.conv_backward(s_BTD, weights, doc_ids_BT, dEc_CBTD)
    T = s_BTD.shape[1]
    dt = dEc_CBTD.dtype
    s = s_BTD.to(dt)
    ds = torch.zeros_like(s)
    dws = []
    for w_KD, dE_BTD in zip(weights, dEc_CBTD):
        K = w_KD.shape[0]
        w = w_KD.to(dt)
        dw = torch.zeros_like(w)
        ds.addcmul_(dE_BTD, w[0])
        dw[0] = (dE_BTD * s).sum((0, 1))
        for delta in range(1, min(K, T)):
            g = dE_BTD[:, delta:]
            if doc_ids_BT is not None:
                same_BT = doc_ids_BT[:, delta:] == doc_ids_BT[:, :-delta]
                g = g * same_BT.unsqueeze(-1).to(dt)
            ds[:, :-delta].addcmul_(g, w[delta])
            dw[delta] = (g * s[:, :-delta]).sum((0, 1))
        dws.append(dw.to(w_KD.dtype))
    return ds, dws


@dataclass(eq=False)
class SourceEntry:
    """Per (source tensor, expansion bank): shared expansion state of one forward/backward."""

    weights: list[torch.Tensor]  # conv weights (empty: no conv expansion)
    doc_ids_BT: torch.Tensor | None
    eps: float
    stamp: tuple
    Ec_CBTD: torch.Tensor | None = None
    rinv_MBT: torch.Tensor | None = None
    dEc_CBTD: torch.Tensor | None = None
    tok: torch.Tensor | None = None  # output of this source's _ExpandNode (None: no grad needed)
    readers: int = 0  # forward reads of this forward (to release the streams after the last one)
    private: bool = False  # read by one target only: its conv backward runs inside that target
    s_ref: object = None  # weakref to the source (memo validation without a reference cycle)
    read_by: set = None  # id()s of the targets that read this entry in its forward (None: none yet)

    def streams(self, s_BTD: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(Ec_CBTD or None, rinv_MBT) of ``s_BTD`` (this entry's source); recomputed when released."""
        if self.rinv_MBT is None or (self.weights and self.Ec_CBTD is None):
            with torch.no_grad():
                s = s_BTD.detach()
                ws = [w.detach() for w in self.weights]
                if cpu_native.conv_usable(s, ws):  # streams and their sums of squares in one pass
                    self.Ec_CBTD, sq = cpu_native.conv_forward(s, ws, self.doc_ids_BT)
                    self.rinv_MBT = torch.rsqrt(sq.div_(s.shape[-1]).add_(self.eps))
                    return self.Ec_CBTD, self.rinv_MBT
                Ec = conv_streams(s, [w.detach() for w in self.weights], self.doc_ids_BT) if self.weights else None
                sd = stat_dtype(s.dtype)
                D = s.shape[-1]
                # ||x|| in one reduction (no squared temporary); rinv = 1 / sqrt(mean(x^2) + eps)
                n0 = torch.linalg.vector_norm(s, dim=-1, dtype=sd)[None]
                n = n0 if Ec is None else torch.cat([n0, torch.linalg.vector_norm(Ec, dim=-1, dtype=sd)])
                self.Ec_CBTD, self.rinv_MBT = Ec, torch.rsqrt(n.square_().div_(D).add_(self.eps))
        return self.Ec_CBTD, self.rinv_MBT

    def release(self) -> None:
        self.Ec_CBTD = None


class _ExpandNode(torch.autograd.Function):
    """Gradient sink of one source's conv streams (see the module docstring)."""

    @staticmethod
    def forward(ctx, entry: SourceEntry, runtime: Runtime, key: tuple, s_BTD: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        # Weak references only: the runtime's memo holds entry -> tok -> this node, nothing points back.
        ctx.entry, ctx.runtime, ctx.key = weakref.ref(entry), weakref.ref(runtime), key
        ctx.save_for_backward(s_BTD, *weights)
        return s_BTD.new_zeros(0)

    @staticmethod
    def backward(ctx, _dtok):
        entry, runtime = ctx.entry(), ctx.runtime()
        s_BTD, *weights = ctx.saved_tensors
        if runtime is not None and entry is not None and runtime.memo.get(ctx.key) is entry:
            del runtime.memo[ctx.key]
        if entry is None or entry.dEc_CBTD is None:
            return (None, None, None, None, *([None] * len(weights)))
        # ``entry.tok`` stays: a graph kept with ``retain_graph`` (DeepSpeed's pipeline engine runs
        # one backward per stage output) runs the readers and this sink again in a later pass.
        dEc, entry.dEc_CBTD = entry.dEc_CBTD, None
        entry.release()
        ds, dws = conv_streams_backward(s_BTD.detach(), [w.detach() for w in weights], entry.doc_ids_BT, dEc)
        return (None, None, None, ds.to(s_BTD.dtype), *dws)


def source_entry(
    runtime: Runtime,
    s_BTD: torch.Tensor,
    weights: list[torch.Tensor],
    doc_ids_BT: torch.Tensor | None,
    eps: float,
    key: int,
    reader: int | None = None,
) -> SourceEntry:
    """The entry of ``s_BTD`` for expansion ``key`` in the runtime's memo, invalidated by in-place
    changes of the source or of the conv weights, and renewed when ``reader`` (the reading target's
    id) has read it before: that is a new forward of the same source tensor (one carry fed to two
    forwards), whose graph needs its own sink and gradient buffer."""
    memo = runtime.memo
    stamp = (s_BTD._version, tuple(w._version for w in weights), eps)
    mkey = (id(s_BTD), key)
    e = memo.get(mkey)
    again = e is not None and reader is not None and e.read_by is not None and reader in e.read_by
    if again or e is None or e.s_ref() is not s_BTD or e.doc_ids_BT is not doc_ids_BT or e.stamp != stamp:
        e = SourceEntry(list(weights), doc_ids_BT, eps, stamp)
        e.s_ref = weakref.ref(s_BTD)
        memo[mkey] = e
    if reader is not None:
        e.read_by = {reader} if e.read_by is None else e.read_by | {reader}
    need_grad = torch.is_grad_enabled() and (s_BTD.requires_grad or any(w.requires_grad for w in weights))
    if need_grad and e.tok is None and weights:
        e.tok = _ExpandNode.apply(e, runtime, mkey, s_BTD, *weights)
    return e


def _streams_of(e: SourceEntry, s_BTD: torch.Tensor, M: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([stream_BTD] * M, rinv_MBT) of an entry; ``expansion: none`` repeats the identity."""
    Ec, rinv = e.streams(s_BTD)
    s = s_BTD.detach()
    if Ec is None:
        return [s] * M, rinv.expand(M, *rinv.shape[1:])
    return [s, *Ec.unbind(0)], rinv


def _logits(streams: list[torch.Tensor], rinv_MBT: torch.Tensor, qg_MD: torch.Tensor) -> torch.Tensor:
    sd = rinv_MBT.dtype
    q = qg_MD.to(streams[0].dtype)
    if cpu_native.usable(streams[0], q) and all(E.is_contiguous() for E in streams):
        D = q.shape[-1]
        L = torch.cat([cpu_native.row_dots(E.view(-1, D), q[r : r + 1]) for r, E in enumerate(streams)])
        return L.view_as(rinv_MBT).to(sd) * rinv_MBT
    return torch.stack([(E @ q[r]).to(sd) for r, E in enumerate(streams)]) * rinv_MBT


def _weighted(p_SMBT: torch.Tensor, streams_S: list[list[torch.Tensor]], M: int) -> torch.Tensor:
    """z_MBTD = sum_j p_j * E_j, accumulated per stream (no stacked copy of the sources)."""
    first = streams_S[0][0]
    if cpu_native.usable(first, p_SMBT) and all(e.is_contiguous() for st in streams_S for e in st):
        return cpu_native.weighted_sum(p_SMBT.reshape(len(streams_S), M, -1), streams_S)[0]
    out = torch.empty(M, *first.shape, dtype=first.dtype, device=first.device)
    for r in range(M):
        acc = torch.mul(streams_S[0][r], p_SMBT[0, r].unsqueeze(-1).to(first.dtype), out=out[r])
        for j in range(1, len(streams_S)):
            acc.addcmul_(p_SMBT[j, r].unsqueeze(-1).to(first.dtype), streams_S[j][r])
    return out


class TargetFn(torch.autograd.Function):
    """``h_BTD`` of one target from its sources; saves only the sources, parameters and lse."""

    @staticmethod
    def forward(ctx, target, entries, M, n_fusion, qg_MD, *tensors):
        # tensors: fusion params (n_fusion), then per entry (s_BTD, tok or empty), then the weights
        # of the partial's expansion (for the last entry when ctx.partial_weights).
        fusion_params = tensors[:n_fusion]
        srcs = tensors[n_fusion : n_fusion + 2 * len(entries) : 2]
        with torch.no_grad():
            streams_S, rinvs = zip(*(_streams_of(e, s, M) for e, s in zip(entries, srcs)))
            if qg_MD is None:  # a single source: softmax weight 1
                lse = None
                p = torch.ones(1, M, *rinvs[0].shape[1:], dtype=rinvs[0].dtype, device=rinvs[0].device)
            else:
                L = torch.stack([_logits(st, ri, qg_MD) for st, ri in zip(streams_S, rinvs)])
                lse = torch.logsumexp(L, 0)
                p = torch.exp(L - lse)
            z = _weighted(p, streams_S, M)
            h, ctx.fsaved = fuse_forward(target, z)
        ctx.target, ctx.entries, ctx.M, ctx.n_fusion = target, entries, M, n_fusion
        ctx.compiled = bool(getattr(target.__dict__.get("_kernel"), "name", "") == "compile")
        ctx.save_for_backward(qg_MD, lse, *fusion_params, *srcs)
        return h

    @staticmethod
    def backward(ctx, dh_BTD):
        target, entries, M = ctx.target, ctx.entries, ctx.M
        qg_MD, lse, *rest = ctx.saved_tensors
        srcs = rest[ctx.n_fusion :]  # the fusion parameters are saved for autograd's version check only
        dh_BTD = dh_BTD.contiguous()
        streams_S, rinvs = zip(*(_streams_of(e, s, M) for e, s in zip(entries, srcs)))
        streams_S = list(streams_S)
        with torch.no_grad():
            if qg_MD is None:
                L = None
                p = torch.ones(1, M, *rinvs[0].shape[1:], dtype=rinvs[0].dtype, device=rinvs[0].device)
            else:
                L = torch.stack([_logits(st, ri, qg_MD) for st, ri in zip(streams_S, rinvs)])
                p = torch.exp(L - lse)
            z = _weighted(p, streams_S, M)
            dz, dfusion = fuse_backward(target, z, dh_BTD, ctx.fsaved)
        D = dz.shape[-1]
        sd = stat_dtype(dz.dtype)
        dqg = None
        ds_out = []
        if L is not None:
            gz = torch.linalg.vecdot(dz, z).to(sd)  # <dz, z> per (r, token)
            dqg = torch.zeros_like(qg_MD, dtype=sd)
        dt = dz.dtype
        grads_in: list[torch.Tensor | None] = []
        extra: list[torch.Tensor] = []  # conv-weight gradients of the private entries, in order
        # One source at a time: its stream gradients are folded into the source's gradient (or its
        # sink's buffer) before the next source's are formed, so only one M*B*T*D block is live.
        for j, (e, streams, rinv) in enumerate(zip(entries, streams_S, rinvs)):
            # Identity stream and conv streams in separate storages: the conv part may become the
            # source's gradient buffer, the identity part is returned to autograd.
            dE = [torch.empty(dz.shape[1:], dtype=dt, device=dz.device)]
            if M > 1:
                dE += list(torch.empty(M - 1, *dz.shape[1:], dtype=dt, device=dz.device).unbind(0))
            for r in range(M):
                E, pr = streams[r], p[j, r]
                if ctx.compiled and L is not None:
                    d, dq = _compiled_stream_backward()(dz[r], E, pr, gz[r], rinv[r], L[j, r], qg_MD[r])
                    dE[r].copy_(d)
                    dqg[r] += dq
                    continue
                d = torch.mul(dz[r], pr.unsqueeze(-1).to(dt), out=dE[r])
                if L is not None:
                    dl = pr * (torch.linalg.vecdot(dz[r], E).to(sd) - gz[r])  # dlogit
                    a1 = dl * rinv[r]
                    a2 = -a1 * L[j, r] * rinv[r] / D
                    d.addcmul_(a2.unsqueeze(-1).to(dt), E)
                    d.view(-1, D).addr_(a1.reshape(-1).to(dt), qg_MD[r].to(dt))
                    dqg[r] += (a1.reshape(-1).to(E.dtype) @ E.reshape(-1, D)).to(sd)
            is_partial = e.private
            ds = dE[0]
            if e.weights:
                dEc = dE[1]._base  # the [C,B,T,D] conv part
                if is_partial:  # read by this target only: backpropagate its conv here
                    ds_c, dws = conv_streams_backward(srcs[j].detach(), [w.detach() for w in e.weights], e.doc_ids_BT, dEc)
                    extra += dws
                    ds = ds + ds_c.to(ds.dtype)
                elif e.tok is not None:
                    e.dEc_CBTD = dEc if e.dEc_CBTD is None else e.dEc_CBTD.add_(dEc)
            else:
                for r in range(1, M):  # expansion 'none': M copies of the identity
                    ds = ds + dE[r]
            del dE
            if is_partial or not e.weights or e.tok is None:
                # Nothing later reads this entry's streams (a shared entry's sink releases its own):
                # drop them, or every target's node would keep its sources' streams to the graph's end.
                e.release()
            streams_S[j] = None
            ds_out.append(ds.to(srcs[j].dtype))
            grads_in.append(None if e.tok is None or is_partial else e.tok.new_zeros(0))
        flat = []
        for ds, g in zip(ds_out, grads_in):
            flat += [ds, g]
        flat += extra
        dqg_out = None if dqg is None else dqg.to(qg_MD.dtype)
        return (None, None, None, None, dqg_out, *dfusion, *flat)


def target_forward(target, sources: list[tuple[torch.Tensor, object]], partial, banks, doc_ids_BT, M: int, runtime=None) -> torch.Tensor:
    """``h_BTD`` of ``target`` over ``sources`` (completed, then the partial if any).

    ``banks[j]`` is the expansion of source j (the partial uses ``banks[len(sources)]``)."""
    eps = target.eps
    runtime = runtime if runtime is not None else Runtime()
    # Inside a saved-tensor-hooks region (torch.utils.checkpoint, non-reentrant) the recompute must
    # save exactly what the forward saved, so expansions are not shared across targets there: each
    # target expands and backpropagates its own sources (slower, same values).
    shared = torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    entries, flat, extra = [], [], []
    n = len(sources) + int(partial is not None)
    for j, s in enumerate([*sources, partial] if partial is not None else sources):
        ws = list(banks[j].weights) if banks[j].conv else []
        if shared and j < len(sources):
            if j == 0 and runtime.memo.get((id(s), id(banks[0]))) is None:
                runtime.new_forward()
            e = source_entry(runtime, s, ws, doc_ids_BT, eps, id(banks[j]), reader=id(target))
        else:  # the partial (read once) or unshared: no memo, no sink
            e = SourceEntry(ws, doc_ids_BT, eps, (), private=bool(ws))
            extra += ws
        entries.append(e)
        flat += [s, e.tok if e.tok is not None else s.new_zeros(0)]
    assert len(entries) == n
    fusion_params = [target.fusion_scale, target.fusion_weight, target.fusion_bias] if target.fusion == "adaptive" else []
    qg = None if target.single_source else target.qg()
    h = TargetFn.apply(target, entries, M, len(fusion_params), qg, *fusion_params, *flat, *extra)
    for e in entries:
        if e.private:
            e.release()  # recomputed in the backward
    if shared:
        runtime.after_read(entries[: len(sources)])
    return h


class Runtime:
    """Per-model state of the lean path: learns how many local targets read each source (on the
    first forward) and releases a source's forward streams after its last reader."""

    def __init__(self) -> None:
        self.reads: dict[int, int] = {}  # id(first conv weight of a bank) -> local readers per forward (learnt)
        # (id(source), id(bank)) -> SourceEntry of the forward(s) in flight. Entries leave when their
        # sink's backward has run, or when a new forward starts (a forward whose backward never
        # runs keeps its sources alive until then; in-flight micro-batches keep theirs via autograd).
        self.memo: dict[tuple, SourceEntry] = {}
        # (id(block's targets), ids of its completed sources) -> lean_block.BlockGroup of this forward.
        self.groups: dict[tuple, object] = {}

    def new_forward(self) -> None:
        self.memo = {}
        self.groups = {}

    def after_read(self, entries: list[SourceEntry]) -> None:
        for e in entries:
            key = id(e.weights[0]) if e.weights else None
            if key is None:
                continue
            e.readers += 1
            known = self.reads.get(key)
            if known is None or e.readers > known:
                self.reads[key] = e.readers  # still learning (first forward)
            elif e.readers == known:
                e.release()  # last local reader of this forward: do not hold the streams


def _stream_backward(dz_BTD, E_BTD, p_BT, gz_BT, rinv_BT, L_BT, qg_D):
    """Softmax + key-norm backward of one (source, stream): (dE_BTD, dqg_D). Same math as the
    eager loop in ``TargetFn.backward``; ``residual.kernel: compile`` runs it through inductor,
    which fuses it into one pass over the stream."""
    sd = p_BT.dtype
    dl = p_BT * ((dz_BTD * E_BTD).sum(-1).to(sd) - gz_BT)
    a1 = dl * rinv_BT
    a2 = -a1 * L_BT * rinv_BT / E_BTD.shape[-1]
    dt = dz_BTD.dtype
    dE = p_BT.unsqueeze(-1).to(dt) * dz_BTD + a2.unsqueeze(-1).to(dt) * E_BTD + a1.unsqueeze(-1).to(dt) * qg_D.to(dt)
    dqg = (a1.unsqueeze(-1).to(dt) * E_BTD).sum((0, 1)).to(sd)
    return dE, dqg


_COMPILED: dict[str, object] = {}


def _compiled_stream_backward():
    if "bwd" not in _COMPILED:
        _COMPILED["bwd"] = torch.compile(_stream_backward, dynamic=False, fullgraph=True)
    return _COMPILED["bwd"]


def use_compiled(on: bool) -> None:
    """Compile the helpers ahead of the first backward (``residual.kernel: compile``)."""
    if on:
        _compiled_stream_backward()


# Fusion (spec: H = sigmoid(s * RMSNorm([z_1..z_M]) @ W + b), h = sum_r H_r z_r) without autograd: the
# forward keeps three per-token statistics (H, the unscaled gate logits u @ W, the inverse RMS rs:
# 2M + 1 values per token); the backward is a few passes over z and no recompute of the forward.
# With u = x * rs (x = the M streams side by side), du = s * dg @ W^T and mean(du . u) needs no pass:
# it is s * sum_m dg_m (u @ W)_m / (M D).


def fuse_forward(target, z_MBTD: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(h_BTD, saved) of ``target.fuse(z_MBTD)``; ``saved`` feeds :func:`fuse_backward`."""
    M, B, T, D = z_MBTD.shape
    if target.fusion == "mean":
        return (z_MBTD[0] if M == 1 else z_MBTD.mean(0)), ()  # one stream (AttnRes): h is z, no copy
    N = B * T
    z = z_MBTD.reshape(M, N, D)
    if _native_fusion(target, z):  # one pass over z per token
        p = target.fusion_scale, target.fusion_weight, target.fusion_bias
        h, H, uW, rs = cpu_native.fuse_forward(z, p[1].detach(), float(p[0]), p[2].detach(), target.eps)
        return h.view(B, T, D), (H, uW, rs)
    W = target.fusion_weight.detach().to(z.dtype)
    sq = torch.linalg.vector_norm(z, dim=-1).square_().sum(0)  # N
    rs = torch.rsqrt(sq / (M * D) + target.eps)
    xW = z[0] @ W[:D]
    for r in range(1, M):
        xW.addmm_(z[r], W[r * D : (r + 1) * D])
    uW = xW * rs.unsqueeze(-1)
    H = torch.sigmoid(target.fusion_scale.detach().to(z.dtype) * uW + target.fusion_bias.detach().to(z.dtype))  # N, M
    h = torch.mul(z[0], H[:, :1])
    for r in range(1, M):
        h.addcmul_(z[r], H[:, r : r + 1])
    return h.view(B, T, D), (H, uW, rs)


def _native_fusion(target, z_MND: torch.Tensor, *more: torch.Tensor) -> bool:
    w = target.fusion_weight
    return z_MND.shape[0] <= 64 and z_MND.is_contiguous() and w.dtype == z_MND.dtype and cpu_native.usable(z_MND, w, *more)


def fuse_backward(target, z_MBTD: torch.Tensor, dh_BTD: torch.Tensor, saved: tuple) -> tuple[torch.Tensor, list]:
    """(dz_MBTD, [d fusion params]) of :func:`fuse_forward` (params in the order scale, weight, bias)."""
    M, B, T, D = z_MBTD.shape
    if target.fusion == "mean":
        if M == 1:
            return dh_BTD.unsqueeze(0), []  # read only by the callers: no copy
        return (dh_BTD / M).unsqueeze(0).expand(M, B, T, D).contiguous(), []
    N = B * T
    H, uW, rs = saved
    z = z_MBTD.reshape(M, N, D)
    dh = dh_BTD.reshape(N, D).to(z.dtype)
    p = target.fusion_scale, target.fusion_weight, target.fusion_bias
    if _native_fusion(target, z, dh) and H.is_contiguous() and uW.is_contiguous():
        dz, dscale, dW, db = cpu_native.fuse_backward(z, dh.contiguous(), H, uW, rs, p[1].detach(), float(p[0]))
        return dz.view(M, B, T, D), [dscale.to(p[0].dtype), dW.to(p[1].dtype), db.to(p[2].dtype)]
    W = target.fusion_weight.detach().to(z.dtype)
    s = target.fusion_scale.detach().to(z.dtype)
    dH = torch.stack([torch.linalg.vecdot(dh, z[r]) for r in range(M)], 1)  # N, M
    dg = dH * H * (1 - H)
    dscale = (dg * uW).sum().reshape(1)
    db = dg.sum(0)
    dg_rs = dg * rs.unsqueeze(-1)
    dW = torch.cat([z[r].t() @ dg_rs for r in range(M)]) * s
    c = (dg * uW).sum(-1) * s / (M * D)  # mean(du . u) per token
    t = dg_rs * s
    coef = -(rs * rs * c).unsqueeze(-1)
    dz = torch.empty_like(z)
    for r in range(M):
        d = torch.mm(t, W[r * D : (r + 1) * D].t(), out=dz[r])
        d.addcmul_(dh, H[:, r : r + 1])
        d.addcmul_(z[r], coef)
    p = target.fusion_scale, target.fusion_weight, target.fusion_bias
    return dz.view(M, B, T, D), [dscale.to(p[0].dtype), dW.to(p[1].dtype), db.to(p[2].dtype)]


class FuseFn(torch.autograd.Function):
    """``target.fuse(z_MBTD)`` with adaptive fusion through :func:`fuse_forward` / :func:`fuse_backward`
    (no [B,T,M*D] copy or normalised copy of z; saves z and 3 per-token statistics). For callers that
    hold z as an autograd tensor (the Triton path)."""

    @staticmethod
    def forward(ctx, target, z_MBTD, scale, weight, bias):
        with torch.no_grad():
            h, saved = fuse_forward(target, z_MBTD)
        ctx.target, ctx.fsaved = target, saved
        ctx.save_for_backward(z_MBTD)
        return h

    @staticmethod
    def backward(ctx, dh_BTD):
        (z,) = ctx.saved_tensors
        with torch.no_grad():
            dz, (dscale, dW, db) = fuse_backward(ctx.target, z, dh_BTD.contiguous(), ctx.fsaved)
        return None, dz, dscale, dW, db


def fuse(target, z_MBTD: torch.Tensor) -> torch.Tensor:
    """``target.fuse(z_MBTD)`` (same values), adaptive fusion through :class:`FuseFn`."""
    if target.fusion != "adaptive":
        return target.fuse(z_MBTD)
    return FuseFn.apply(target, z_MBTD, target.fusion_scale, target.fusion_weight, target.fusion_bias)
