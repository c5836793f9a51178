"""Slow explicit-loop references written straight from ../shared/spec/residuals.md.

They share no code with ``msar_train.residual`` / ``msar_train.kernels``: sources are rebuilt from the
list of every branch output, convs and softmaxes are explicit loops. Only parameters are read from
the model under test.
"""

from __future__ import annotations

import math

import torch


def ref_rmsnorm(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_conv(s_BTD, w_KD, doc_BT=None):
    B, T, D = s_BTD.shape
    out = torch.zeros_like(s_BTD)
    for b in range(B):
        for t in range(T):
            acc = torch.zeros(D, dtype=s_BTD.dtype)
            for delta in range(w_KD.shape[0]):
                src = t - delta
                if src < 0:
                    continue
                if doc_BT is not None and doc_BT[b, src] != doc_BT[b, t]:
                    continue
                acc = acc + w_KD[delta] * s_BTD[b, src]
            out[b, t] = acc
    return out


def ref_streams(s, bank, m, doc=None):
    if len(bank.weights) == 0:
        return [s] * m
    return [s] + [ref_conv(s, w, doc) for w in bank.weights]


def ref_target(target, sources, banks, m, eps, doc=None):
    """sources: list of (tensor, bank index). Explicit softmax per stream; then the fusion."""
    zs = []
    if target.single_source:
        assert len(sources) == 1
        zs = ref_streams(sources[0][0], banks[sources[0][1]], m, doc)
    for r in range(m if not zs else 0):
        Es = [ref_streams(s, banks[j], m, doc)[r] for s, j in sources]
        logits = [((target.query[r] * target.key_norm[r]) * ref_rmsnorm(E, eps)).sum(-1) for E in Es]
        mx = torch.stack(logits).max(0).values
        w = [torch.exp(lg - mx) for lg in logits]
        den = sum(w)
        zs.append(sum(wi.unsqueeze(-1) * E for wi, E in zip(w, Es)) / den.unsqueeze(-1))
    if target.fusion == "mean":
        return sum(zs) / m
    flat = torch.cat(zs, dim=-1)
    H = torch.sigmoid(target.fusion_scale * (ref_rmsnorm(flat, eps) @ target.fusion_weight) + target.fusion_bias)
    return sum(H[..., r : r + 1] * zs[r] for r in range(m))


def branch_fns(block, ctx):
    def attn(h):
        return block.attn(block.attn_norm(h), ctx)

    def ffn(h):
        y = block.ffn(block.ffn_norm(h))
        return y[0] if isinstance(y, tuple) else y

    return [attn, ffn]


def block_ranges(L, N):
    """Spec blocks: N contiguous blocks, sizes differ by at most one, longer first."""
    sizes = [L // N + (1 if n < L % N else 0) for n in range(N)]
    out, start = [], 1
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out


def ref_depth_forward(model, ids, doc=None, pos=None):
    """Block/Full AttnRes / MSAR forward from the list of all branch outputs v_0..v_L."""
    from msar_train.residual.base import SeqContext

    ctx = SeqContext(doc, pos)
    be = model.backend
    L, m, eps = be.n_branches, be.num_streams, be.norm_eps
    N = be.layout.n_blocks
    blocks = block_ranges(L, N)
    v = {0: model.embed.tok(ids)}
    sites = [s for blk in model.blocks for s in (blk.attn_site, blk.ffn_site)]
    fns = [f for blk in model.blocks for f in branch_fns(blk, ctx)]
    for l in range(1, L + 1):
        n = next(k for k, br in enumerate(blocks, start=1) if l in br)
        srcs = [(v[0], 0)] + [(sum(v[i] for i in blocks[k - 1]), k) for k in range(1, n)]
        before = [i for i in blocks[n - 1] if i < l]
        if before:
            srcs.append((sum(v[i] for i in before), n))
        site = sites[l - 1]
        h = ref_target(site.target, srcs, site.banks, m, eps, doc)
        v[l] = fns[l - 1](h)
    srcs = [(v[0], 0)] + [(sum(v[i] for i in blocks[k - 1]), k) for k in range(1, N + 1)]
    ex = model.head.exit
    h = ref_target(ex.target, srcs, ex.banks, m, eps, doc)
    return model.head.out(model.head.norm(h))


def ref_vanilla_forward(model, ids):
    from msar_train.residual.base import SeqContext

    ctx = SeqContext()
    vs = [model.embed.tok(ids)]
    for blk in model.blocks:
        for f in branch_fns(blk, ctx):
            vs.append(f(sum(vs)))
    return model.head.out(model.head.norm(sum(vs)))


def ref_sinkhorn(logits_NN, iters):
    M = [[math.exp(float(x)) for x in row] for row in logits_NN]
    n = len(M)
    for _ in range(iters):
        M = [[x / sum(row) for x in row] for row in M]
        cols = [sum(M[i][j] for i in range(n)) for j in range(n)]
        M = [[M[i][j] / cols[j] for j in range(n)] for i in range(n)]
    return torch.tensor(M, dtype=torch.float64)


def ref_mhc_forward(model, ids):
    """mHC with explicit per-token loops for the maps and the stream update."""
    from msar_train.residual.base import SeqContext

    ctx = SeqContext()
    h = model.embed.tok(ids)
    n = model.backend.cfg.mhc_streams
    B, T, D = h.shape
    x = [[[h[b, t].clone() for _ in range(n)] for t in range(T)] for b in range(B)]
    for blk in model.blocks:
        for site, f in zip((blk.attn_site, blk.ffn_site), branch_fns(blk, ctx)):
            pre = torch.zeros(B, T, D, dtype=h.dtype)
            maps = {}
            for b in range(B):
                for t in range(T):
                    flat = torch.cat(x[b][t])
                    xn = flat / torch.sqrt((flat * flat).mean() + site.eps)
                    hp = torch.sigmoid(site.a_pre * (xn @ site.w_pre) + site.b_pre)
                    hq = 2 * torch.sigmoid(site.a_post * (xn @ site.w_post) + site.b_post)
                    hr = ref_sinkhorn((site.a_res * (xn @ site.w_res)).reshape(n, n) + site.b_res, site.iters)
                    maps[b, t] = (hq, hr)
                    pre[b, t] = sum(hp[i] * x[b][t][i] for i in range(n))
            fo = f(pre)
            for b in range(B):
                for t in range(T):
                    hq, hr = maps[b, t]
                    old = x[b][t]
                    x[b][t] = [sum(hr[i, j] * old[j] for j in range(n)) + hq[i] * fo[b, t] for i in range(n)]
    out = torch.stack([torch.stack([sum(x[b][t]) / n for t in range(T)]) for b in range(B)])
    return model.head.out(model.head.norm(out))
