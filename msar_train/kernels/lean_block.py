"""Block-batched two-phase depth attention on the lean torch path (the default for ``residual.kernel:
torch | compile``; spec "Two-phase computation").

Legend: S completed sources, M streams, Q targets of one block (local to this process), B batch,
T sequence, N = B*T tokens, D d_model.

All targets of block n read the same completed summaries ``b_0 .. b_{n-1}``. At the first target of
the block that runs (in a pipeline stage: the first local one), :class:`Phase1Node` computes phase 1
for all Q targets at once: the logits of every (source, stream) against the stacked pseudo-queries
as one ``[N, D] @ [D, Q]`` product, and the softmax statistics ``lse1 [M, Q, N]``. It keeps only
those (fp32, ``(S + 1) * M * Q`` per token: no tensor of size M*N*D). Each target then
(:class:`BlockTargetFn`) forms its phase-1 output ``z1 = sum_j exp(L_j - lse1) E_j`` from the shared
streams, merges its partial by online softmax (``a = sigmoid(lse1 - l2)``, ``z = a z1 + (1 - a) E2``)
and fuses. Its backward recomputes ``z1`` (nothing of size M*N*D is saved), runs the fusion and the
partial's gradients and leaves the gradient of its phase-1 output (``a * dz``) and of ``lse1`` with the
block's group; ``Phase1Node.backward``, which autograd runs once after every target of the block,
turns them into the completed sources' and all Q queries' gradients in one pass per (source, stream):
the key-norm term of all targets is one ``[N, Q] @ [Q, D]`` product and the query gradients one
``[Q, N] @ [N, D]``, instead of Q separate passes each.

Conv streams go through the same per-source entries and gradient sinks as the per-target path
(``kernels/lean.py``). Inside a saved-tensor-hooks region (activation checkpointing) the targets
run the per-target path instead (a checkpointed layer's recompute must not depend on another layer's
state).
"""

from __future__ import annotations

import weakref

import torch

from msar_train.kernels import cpu_native, lean


class BlockGroup:
    """Phase-1 state of one block in one forward: the shared entries, logits and statistics, and the
    gradients its targets leave for :class:`Phase1Node`'s backward."""

    def __init__(self, peers: list, entries: list, sources: list[torch.Tensor]):
        self.peers = peers
        self.entries = entries
        self.s_refs = [weakref.ref(s) for s in sources]
        self.read_by: set[int] = set()
        self.L_SMQN: torch.Tensor | None = None
        self.lse_MQN: torch.Tensor | None = None
        self.tokens: list[torch.Tensor] | None = None  # per target: an output of Phase1Node
        # q -> (dz_MBTD, dlse_MBT, a_MN): target q's phase-1 output gradient is a * dz (a None: 1)
        self.grads: dict[int, tuple] = {}

    def matches(self, sources: list[torch.Tensor]) -> bool:
        return len(sources) == len(self.s_refs) and all(r() is s for r, s in zip(self.s_refs, sources))

    def p(self, q: int) -> torch.Tensor:
        """Softmax weights ``[S, M, N]`` of target q over the completed sources."""
        return torch.exp(self.L_SMQN[:, :, q] - self.lse_MQN[:, q])


def _streams(group: BlockGroup, sources: list[torch.Tensor], M: int):
    return [lean._streams_of(e, s, M) for e, s in zip(group.entries, sources)]


def _z1(group: BlockGroup, q: int, streams_S, M: int) -> torch.Tensor:
    p = group.p(q)  # S, M, N
    first = streams_S[0][0][0]
    B, T, D = first.shape
    if cpu_native.usable(first, p):
        return cpu_native.weighted_sum(p, [st for st, _ in streams_S])[0]
    out = torch.empty(M, B, T, D, dtype=first.dtype, device=first.device)
    dt = first.dtype
    for r in range(M):
        acc = torch.mul(streams_S[0][0][r], p[0, r].view(B, T, 1).to(dt), out=out[r])
        for j in range(1, len(streams_S)):
            acc.addcmul_(p[j, r].view(B, T, 1).to(dt), streams_S[j][0][r])
    return out


class Phase1Node(torch.autograd.Function):
    """Phase 1 of all Q targets of a block over its completed sources (see the module docstring).
    Outputs one empty token per target (the autograd edge that makes this backward run after theirs)."""

    @staticmethod
    def forward(ctx, group: BlockGroup, M: int, Q: int, *tensors):
        # tensors: the Q targets' qg_MD (separate inputs: a target that never reads gets no gradient),
        # then per completed source (s_BTD, tok or empty).
        QG_QMD = torch.stack(tensors[:Q]).detach()
        srcs = tensors[Q::2]
        with torch.no_grad():
            streams_S = _streams(group, list(srcs), M)
            rows = []
            for streams, rinv_MBT in streams_S:
                sd = rinv_MBT.dtype
                N = rinv_MBT[0].numel()
                per_r = []
                for r in range(M):
                    E = streams[r].reshape(N, -1)
                    if cpu_native.usable(E, QG_QMD) and E.is_contiguous():  # all Q logits in one read of E
                        per_r.append(cpu_native.row_dots(E, QG_QMD[:, r]).to(sd) * rinv_MBT[r].reshape(1, N))
                        continue
                    per_r.append((E @ QG_QMD[:, r].to(E.dtype).t()).t().to(sd) * rinv_MBT[r].reshape(1, N))
                rows.append(torch.stack(per_r))  # M, Q, N
            L = torch.stack(rows)  # S, M, Q, N
            group.L_SMQN, group.lse_MQN = L, torch.logsumexp(L, 0)
        ctx.group, ctx.M = weakref.ref(group), M
        ctx.save_for_backward(QG_QMD, *srcs)
        ctx.qg_dtype = tensors[0].dtype
        return tuple(QG_QMD.new_zeros(0) for _ in range(Q))

    @staticmethod
    def backward(ctx, *_dtoks):
        group, M = ctx.group(), ctx.M
        QG, *srcs = ctx.saved_tensors
        n_in = 2 * len(srcs)
        Q = QG.shape[0]
        if group is None or not group.grads:
            return (None, None, None, *([None] * (Q + n_in)))
        grads, group.grads = group.grads, {}
        qs = sorted(grads)
        streams_S = _streams(group, srcs, M)
        L, lse = group.L_SMQN, group.lse_MQN
        sd = L.dtype
        first = streams_S[0][0][0]
        B, T, D = first.shape
        N = B * T
        dt = grads[qs[0]][0].dtype
        P = torch.exp(L[:, :, qs] - lse[:, qs])  # S, M, Qd, N
        # Pass 1: <dz1_q, E_j> for every (source, stream, target); gsum = <dz1_q, z1_q>.
        dots = torch.empty_like(P)
        native = (
            cpu_native.usable(first, P, *[grads[q][0] for q in qs])
            and all(e.is_contiguous() for st, _ in streams_S for e in st)
            and all(grads[q][0].is_contiguous() for q in qs)
        )
        gl = [[grads[q][0][r].view(N, D) for q in qs] for r in range(M)] if native else None  # per stream: Qd [N, D]
        for j, (streams, _) in enumerate(streams_S):
            for r in range(M):
                E = streams[r].reshape(N, D)
                if native:  # one read of E for all Qd targets
                    dots[j, r] = cpu_native.phase1_dots(E, gl[r])
                    continue
                for i, q in enumerate(qs):
                    dots[j, r, i] = torch.linalg.vecdot(grads[q][0][r].reshape(N, D), E).to(sd)
        # Target q's phase-1 output gradient is a_q * dz_q (a_q: its merge weight; 1 without a partial).
        A = torch.stack([grads[q][2] if grads[q][2] is not None else torch.ones_like(P[0, :, 0]) for q in qs], 1).to(sd)  # M, Qd, N
        dots *= A
        PA = P * A  # the weights of the dz_q terms in the sources' stream gradients
        gsum = (P * dots).sum(0)  # M, Qd, N
        dl = torch.stack([grads[q][1] if grads[q][1] is not None else torch.zeros_like(gsum[:, 0].view(M, B, T)) for q in qs], 1)
        dlogit = P * (dots - gsum + dl.reshape(M, len(qs), N).to(sd))  # S, M, Qd, N
        QGd = QG[qs].to(dt)  # Qd, M, D
        dQG = torch.zeros(Q, M, D, dtype=sd, device=QG.device)
        # softmax-backward coefficients of every (source, stream, target) at once
        R = torch.stack([rinv.reshape(M, N) for _, rinv in streams_S]).unsqueeze(2)  # S, M, 1, N
        A1 = dlogit * R  # S, M, Qd, N
        A2 = (-(A1 * L[:, :, qs]) * R / D).sum(2)  # S, M, N
        if native:
            dQG_r = torch.zeros(M, len(qs), D, dtype=dt)  # per stream: contiguous [Qd, D] accumulators
            qg_rows = [list(QGd[:, r].unbind(0)) for r in range(M)]
        out: list = []
        for j, ((streams, _), e, s) in enumerate(zip(streams_S, group.entries, srcs)):
            dE = [torch.empty(B, T, D, dtype=dt, device=first.device)]
            # Native: the conv streams' gradients are added straight into the sink's buffer when an
            # earlier block left one, and expansion 'none' sums its M identical streams in dE[0].
            into_sink = native and e.weights and e.tok is not None and e.dEc_CBTD is not None
            if M > 1 and not into_sink and not (native and not e.weights):
                dE += list(torch.empty(M - 1, B, T, D, dtype=dt, device=first.device).unbind(0))
            for r in range(M):
                E = streams[r].reshape(N, D)
                a1, a2 = A1[j, r], A2[j, r]  # Qd, N and N
                if native:  # the stream gradient and the queries' gradient in one pass over E
                    if r == 0 or not (into_sink or not e.weights):
                        d, acc = dE[r].view(N, D), False
                    elif into_sink:
                        d, acc = e.dEc_CBTD[r - 1].view(N, D), True
                    else:
                        d, acc = dE[0].view(N, D), True
                    cpu_native.phase1_grad(E, gl[r], PA[j, r], a1, a2, qg_rows[r], d, dQG_r[r], accumulate=acc)
                    continue
                d = dE[r].view(N, D)
                torch.mm(a1.t().to(dt), QGd[:, r], out=d)  # key-norm term of every target at once
                d.addcmul_(a2.unsqueeze(-1).to(dt), E)
                for i, q in enumerate(qs):
                    d.addcmul_(PA[j, r, i].unsqueeze(-1).to(dt), grads[q][0][r].reshape(N, D))
                dQG[qs, r] += (a1.to(E.dtype) @ E).to(sd)
            ds = dE[0]
            if into_sink or (native and not e.weights):
                pass  # already in the sink's buffer / summed in dE[0]
            elif e.weights:
                dEc = dE[1]._base
                if e.tok is not None:
                    e.dEc_CBTD = dEc if e.dEc_CBTD is None else e.dEc_CBTD.add_(dEc)
            else:
                for r in range(1, M):
                    ds = ds + dE[r]
            if not e.weights or e.tok is None:
                e.release()
            del dE
            out += [ds.to(s.dtype), None if e.tok is None else e.tok.new_zeros(0)]
        if native:
            dQG[qs] += dQG_r.transpose(0, 1).to(sd)
        dqgs = [dQG[q].to(ctx.qg_dtype) if q in grads else None for q in range(Q)]
        return (None, None, None, *dqgs, *out)


class BlockTargetFn(torch.autograd.Function):
    """``h_BTD`` of target q of a block: its phase-1 output from the group's statistics, the merge
    with its partial, the fusion. Saves the partial source, its parameters and nothing M*N*D."""

    @staticmethod
    def forward(ctx, target, group, q, M, n_fusion, qg_MD, sources_n, *tensors):
        fusion_params = tensors[:n_fusion]
        srcs = list(tensors[n_fusion : n_fusion + sources_n])
        partial = tensors[n_fusion + sources_n + 1] if len(tensors) > n_fusion + sources_n + 1 else None
        pw = list(tensors[n_fusion + sources_n + 2 :])
        pe = None
        with torch.no_grad():
            if partial is not None:
                pe = lean.SourceEntry(pw, group.doc_ids_BT, target.eps, (), private=bool(pw))
                z = _mixture(group, q, srcs, pe, partial, qg_MD, M, want_z1=False)[0]
                pe.release()
            else:
                z = _z1(group, q, _streams(group, srcs, M), M)
            h, fsaved = lean.fuse_forward(target, z)
        ctx.fsaved = fsaved  # per-token fusion statistics (2M + 1 per token)
        ctx.target, ctx.group, ctx.q, ctx.M, ctx.n_fusion, ctx.n_src = target, group, q, M, n_fusion, sources_n
        ctx.pe_weights = len(pw)
        ctx.has_partial = partial is not None
        saved = [qg_MD, *fusion_params, *srcs] + ([partial, *pw] if partial is not None else [])
        ctx.save_for_backward(*saved)
        return h

    @staticmethod
    def backward(ctx, dh_BTD):
        target, group, q, M = ctx.target, ctx.group, ctx.q, ctx.M
        qg, *rest = ctx.saved_tensors
        srcs = list(rest[ctx.n_fusion : ctx.n_fusion + ctx.n_src])
        partial, pw = None, []
        if ctx.has_partial:
            partial = rest[ctx.n_fusion + ctx.n_src]
            pw = list(rest[ctx.n_fusion + ctx.n_src + 1 :])
        with torch.no_grad():
            if partial is not None:
                pe = lean.SourceEntry(pw, group.doc_ids_BT, target.eps, (), private=bool(pw))
                z, _, a, E2, rinv2, l2 = _mixture(group, q, srcs, pe, partial, qg, M, want_z1=False)
            else:
                z = _z1(group, q, _streams(group, srcs, M), M)
            dz, dfusion = lean.fuse_backward(target, z, dh_BTD.contiguous(), ctx.fsaved)
        dt = dz.dtype
        dqg, ds_p, dws = None, None, []
        if partial is None:
            group.grads[q] = (dz, None, None)
        else:
            sd = a.dtype
            D = dz.shape[-1]
            # d/d(lse1 - l2) = a (1 - a) <dz, z1 - E2> = (1 - a) <dz, z - E2>, as z - E2 = a (z1 - E2):
            # z1 is not needed (not recomputed), and no difference tensor is formed.
            native = cpu_native.usable(dz, z, a, qg) and dz.is_contiguous() and z.is_contiguous() and all(e.is_contiguous() for e in E2)
            if native:  # both dot products in one read of dz
                N = a[0].numel()
                dd = [cpu_native.phase1_dots(dz[r].view(N, D), [z[r].view(N, D), E2[r].view(N, D)]) for r in range(M)]
                x = (1 - a) * torch.stack([(v[0] - v[1]).view_as(a[0]) for v in dd]).to(sd)
            else:
                x = (1 - a) * torch.stack([torch.linalg.vecdot(dz[r], z[r]) - torch.linalg.vecdot(dz[r], E2[r]) for r in range(M)]).to(sd)
            del z
            # Phase 1's output gradient is a * dz: Phase1Node applies the factor a (no scaled copy here).
            group.grads[q] = (dz, x, a.reshape(M, -1))
            a1 = -x * rinv2
            a2 = -a1 * l2 * rinv2 / D
            dqg = torch.zeros_like(qg, dtype=sd)
            dE = torch.empty(M, *dz.shape[1:], dtype=dt, device=dz.device)
            for r in range(M):
                if native:  # dE = (1 - a) dz + a2 E2 + a1 qg and dqg += a1 E2, one pass
                    N = dz[r].numel() // D
                    cpu_native.phase1_grad(
                        E2[r].view(N, D), [dz[r].view(N, D)], (1 - a[r]).view(1, N), a1[r].view(1, N), a2[r].reshape(N), [qg[r]],
                        dE[r].view(N, D), dqg[r : r + 1],
                    )  # fmt: skip
                    continue
                d = torch.mul(dz[r], (1 - a[r]).unsqueeze(-1).to(dt), out=dE[r])
                d.addcmul_(a2[r].unsqueeze(-1).to(dt), E2[r])
                d.view(-1, D).addr_(a1[r].reshape(-1).to(dt), qg[r].to(dt))
                dqg[r] += (a1[r].reshape(-1).to(E2[r].dtype) @ E2[r].reshape(-1, D)).to(sd)
            dqg = dqg.to(qg.dtype)
            ds_p = dE[0]
            if pw:
                ds_c, dws = lean.conv_streams_backward(partial.detach(), [w.detach() for w in pw], group.doc_ids_BT, dE[1:])
                ds_p = ds_p + ds_c.to(ds_p.dtype)
            elif M > 1:
                ds_p = dE.sum(0)
            ds_p = ds_p.to(partial.dtype)
        tail = [] if partial is None else [ds_p, *dws]
        tok_grad = group.tokens[q].new_zeros(0) if group.tokens is not None else None
        return (None, None, None, None, None, dqg, None, *dfusion, *([None] * ctx.n_src), tok_grad, *tail)


def _mixture(group: BlockGroup, q: int, srcs, pe, partial, qg_MD, M: int, want_z1: bool):
    """(z, z1 or None, a, E2 streams, rinv2, l2): target q's phase-1 output z1 merged with its partial
    by online softmax, ``a = sigmoid(lse1 - l2)``, ``z = a z1 + (1 - a) E2`` (z1 only if ``want_z1``)."""
    streams, rinv = lean._streams_of(pe, partial.detach(), M)
    l2 = lean._logits(streams, rinv, qg_MD)  # M, B, T
    a = torch.sigmoid(group.lse_MQN[:, q].view_as(l2) - l2)
    streams_S = _streams(group, srcs, M)
    first = streams[0]
    if cpu_native.usable(first, a) and all(e.is_contiguous() for e in streams):
        p = group.p(q)
        z, z1 = cpu_native.weighted_sum(p, [st for st, _ in streams_S], a.reshape(M, -1), streams, want_z1=want_z1)
        return z, z1, a, streams, rinv, l2
    z1 = _z1(group, q, streams_S, M)
    dt = z1.dtype
    E2 = torch.stack(streams) if M > 1 else streams[0].unsqueeze(0)
    z = z1 * a.unsqueeze(-1).to(dt) + E2 * (1 - a).unsqueeze(-1).to(dt)
    return z, (z1 if want_z1 else None), a, list(E2.unbind(0)), rinv, l2


def block_group(runtime: lean.Runtime, target, peers: list, sources: list[torch.Tensor], banks, doc_ids_BT, M: int) -> BlockGroup:
    """The block's group of this forward (created, with phase 1 for every peer, by the first reader)."""
    key = (id(peers), tuple(id(s) for s in sources))
    g = runtime.groups.get(key)
    if g is None or not g.matches(sources) or id(target) in g.read_by or g.doc_ids_BT is not doc_ids_BT:
        eps = target.eps
        entries = [
            lean.source_entry(runtime, s, list(banks[j].weights) if banks[j].conv else [], doc_ids_BT, eps, id(banks[j]), reader=id(target))
            for j, s in enumerate(sources)
        ]
        g = BlockGroup(peers, entries, sources)
        g.doc_ids_BT = doc_ids_BT
        runtime.groups[key] = g
        flat = [t.qg() for t in peers]
        for e, s in zip(entries, sources):
            flat += [s, e.tok if e.tok is not None else s.new_zeros(0)]
        g.tokens = list(Phase1Node.apply(g, M, len(peers), *flat))
    g.read_by.add(id(target))
    return g


def target_forward(target, peers, sources, partial, banks, doc_ids_BT, M: int, runtime: lean.Runtime) -> torch.Tensor:
    """``h_BTD`` of ``target`` (one of ``peers``, the block's local targets) through its block's group."""
    if sources and runtime.memo.get((id(sources[0]), id(banks[0]))) is None:
        runtime.new_forward()
    g = block_group(runtime, target, peers, sources, banks, doc_ids_BT, M)
    q = peers.index(target)
    fusion_params = [target.fusion_scale, target.fusion_weight, target.fusion_bias] if target.fusion == "adaptive" else []
    extra = []
    if partial is not None:
        bank = banks[len(sources)]
        extra = [partial, *(list(bank.weights) if bank.conv else [])]
    h = BlockTargetFn.apply(target, g, q, M, len(fusion_params), target.qg(), len(sources), *fusion_params, *sources, g.tokens[q], *extra)
    runtime.after_read(g.entries)
    return h
