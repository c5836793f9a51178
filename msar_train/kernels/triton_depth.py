"""Fused Triton kernels of Block MSAR depth attention (``residual.kernel: triton``).

Legend: Q targets (queries), S sources, M streams, K taps (KMAX: the widest), B batch, T sequence,
D d_model, P programs along B*T tiles.

Conv weights arrive as one padded tensor ``W_SMKD`` (fp32; stream 0 is the identity: one tap of 1)
with the per-stream tap counts ``ks_M``; ``expansion: none`` is every stream the identity.

* phase 1 (``phase1``): for Q targets and all M streams at once, each program owns a tile of
  ``BLOCK_T`` tokens x all D channels of one (target, stream); it loops over the completed sources,
  computes the causal (document-masked) conv expansion of each source in registers, its RMS, the
  logit and an online-softmax update. Only ``z1 = o / sum exp`` [Q,M,B,T,D] and ``lse`` [Q,M,B,T]
  are written: the expanded streams never reach memory. Backward recomputes the expansions from
  the sources and the saved lse (two passes: <dz, z1>, then the per-source gradients) and writes the
  gradient of the expanded streams into an fp32 scratch [S,M,B,T,D] (the only M*D-sized buffer; it
  lives during this node's backward only), which a second kernel folds back through the transposed
  conv into the sources' and the conv weights' gradients.
* phase 2 (``phase2``): per target, the partial source's expansion and logit fused with the
  online-softmax merge ``z = sigmoid(lse1 - l2) z1 + sigmoid(l2 - lse1) E2``.

All math is fp32 (inputs are upcast right after each load; bf16 is stored only at the end). The
fusion mixer stays in torch: its input ``z`` [M,B,T,D] is what the gate GEMM reads anyway.
Import this module only when Triton is installed; on CPU set ``TRITON_INTERPRET=1`` first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T_DEFAULT = 16


@triton.jit
def _conv_tile(src_ptr, W_ptr, doc_ptr, j, r, b, offs_t, offs_d, tmask, dmask, doc_t, K, B, T, D, M, KMAX, HAS_DOC: tl.constexpr):
    """E[t, :] = sum_{delta<K} W[j, r, delta, :] * src[j, b, t - delta, :] for the tile (fp32)."""
    E = tl.zeros([offs_t.shape[0], offs_d.shape[0]], dtype=tl.float32)
    base = src_ptr + (j * B + b).to(tl.int64) * T * D
    for delta in range(K):
        tt = offs_t - delta
        valid = tmask & (tt >= 0)
        if HAS_DOC:
            dd = tl.load(doc_ptr + b * T + tt, mask=valid, other=-1)
            valid = valid & (dd == doc_t)
        x = tl.load(base + tt[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(W_ptr + ((j * M + r) * KMAX + delta) * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
        E += x * w[None, :]
    return E


@triton.jit
def _p1_fwd(
    src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, z_ptr, lse_ptr,
    S, B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = tl.program_id(1)
    q = tl.program_id(2)
    b = pid // NTB
    offs_t = (pid % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    dmask = offs_d < D
    K = tl.load(ks_ptr + r)
    qg = tl.load(qg_ptr + (q * M + r) * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in range(S):
        E = _conv_tile(src_ptr, W_ptr, doc_ptr, j, r, b, offs_t, offs_d, tmask, dmask, doc_t, K, B, T, D, M, KMAX, HAS_DOC)
        rinv = tl.rsqrt(tl.sum(E * E, 1) / D + eps)
        logit = tl.sum(E * qg[None, :], 1) * rinv
        m_new = tl.maximum(m_i, logit)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logit - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * E
        m_i = m_new
    row = ((q * M + r) * B + b).to(tl.int64) * T + offs_t
    tl.store(z_ptr + row[:, None] * D + offs_d[None, :], acc / l_i[:, None], mask=tmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + row, m_i + tl.log(l_i), mask=tmask)


@triton.jit
def _p1_bwd(
    src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, lse_ptr, dz_ptr, dlse_ptr, dE_ptr, dqg_ptr,
    S, Q, B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b = pid // NTB
    offs_t = (pid % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    dmask = offs_d < D
    m2 = tmask[:, None] & dmask[None, :]
    K = tl.load(ks_ptr + r)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    for q in range(Q):
        qg = tl.load(qg_ptr + (q * M + r) * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
        row = ((q * M + r) * B + b).to(tl.int64) * T + offs_t
        dz = tl.load(dz_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        lse = tl.load(lse_ptr + row, mask=tmask, other=0.0)
        dl = tl.load(dlse_ptr + row, mask=tmask, other=0.0)
        gsum = tl.zeros([BLOCK_T], dtype=tl.float32)  # <dz, z1> = sum_j p_j <dz, E_j>
        for j in range(S):
            E = _conv_tile(src_ptr, W_ptr, doc_ptr, j, r, b, offs_t, offs_d, tmask, dmask, doc_t, K, B, T, D, M, KMAX, HAS_DOC)
            rinv = tl.rsqrt(tl.sum(E * E, 1) / D + eps)
            logit = tl.sum(E * qg[None, :], 1) * rinv
            p = tl.where(tmask, tl.exp(logit - lse), 0.0)
            gsum += p * tl.sum(dz * E, 1)
        dqg = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(S):
            E = _conv_tile(src_ptr, W_ptr, doc_ptr, j, r, b, offs_t, offs_d, tmask, dmask, doc_t, K, B, T, D, M, KMAX, HAS_DOC)
            rinv = tl.rsqrt(tl.sum(E * E, 1) / D + eps)
            logit = tl.sum(E * qg[None, :], 1) * rinv
            p = tl.where(tmask, tl.exp(logit - lse), 0.0)
            dlogit = p * (tl.sum(dz * E, 1) - gsum + dl)
            a1 = dlogit * rinv
            a2 = -a1 * logit * rinv / D
            dE = p[:, None] * dz + a1[:, None] * qg[None, :] + a2[:, None] * E
            ptr = dE_ptr + (((j * M + r) * B + b).to(tl.int64) * T + offs_t)[:, None] * D + offs_d[None, :]
            tl.store(ptr, tl.load(ptr, mask=m2, other=0.0) + dE, mask=m2)
            dqg += tl.sum(a1[:, None] * E, 0)
        tl.store(dqg_ptr + ((q * M + r) * B * NTB + pid) * D + offs_d, dqg, mask=dmask)


@triton.jit
def _conv_bwd(
    src_ptr, W_ptr, ks_ptr, doc_ptr, dE_ptr, ds_ptr, dW_ptr,
    B, T, D, M, KMAX, NTB,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """ds[j, t] = sum_r sum_delta W[j,r,delta] dE[j,r,t+delta]; dW partials per tile."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    b = pid // NTB
    offs_t = (pid % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    dmask = offs_d < D
    m2 = tmask[:, None] & dmask[None, :]
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    src = src_ptr + (j * B + b).to(tl.int64) * T * D
    ds = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for r in range(M):
        K = tl.load(ks_ptr + r)
        dEb = dE_ptr + ((j * M + r) * B + b).to(tl.int64) * T * D
        g0 = tl.load(dEb + offs_t[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        for delta in range(K):
            w = tl.load(W_ptr + ((j * M + r) * KMAX + delta) * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
            tt = offs_t + delta  # data grad: the anti-causal taps
            valid = tmask & (tt < T)
            if HAS_DOC:
                dd = tl.load(doc_ptr + b * T + tt, mask=valid, other=-1)
                valid = valid & (dd == doc_t)
            g = tl.load(dEb + tt[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            ds += w[None, :] * g
            ts = offs_t - delta  # weight grad: sum_t dE[t] * s[t - delta]
            vs = tmask & (ts >= 0)
            if HAS_DOC:
                ds_doc = tl.load(doc_ptr + b * T + ts, mask=vs, other=-1)
                vs = vs & (ds_doc == doc_t)
            x = tl.load(src + ts[:, None] * D + offs_d[None, :], mask=vs[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            tl.store(dW_ptr + (((j * M + r) * KMAX + delta) * B * NTB + pid) * D + offs_d, tl.sum(g0 * x, 0), mask=dmask)
    tl.store(ds_ptr + ((j * B + b).to(tl.int64) * T + offs_t)[:, None] * D + offs_d[None, :], ds, mask=m2)


@triton.jit
def _p2_fwd(
    z1_ptr, lse_ptr, src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, z_ptr,
    B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b = pid // NTB
    offs_t = (pid % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    dmask = offs_d < D
    m2 = tmask[:, None] & dmask[None, :]
    K = tl.load(ks_ptr + r)
    qg = tl.load(qg_ptr + r * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    E = _conv_tile(src_ptr, W_ptr, doc_ptr, 0, r, b, offs_t, offs_d, tmask, dmask, doc_t, K, B, T, D, M, KMAX, HAS_DOC)
    rinv = tl.rsqrt(tl.sum(E * E, 1) / D + eps)
    l2 = tl.sum(E * qg[None, :], 1) * rinv
    row = (r * B + b).to(tl.int64) * T + offs_t
    lse = tl.load(lse_ptr + row, mask=tmask, other=0.0)
    a = tl.sigmoid(lse - l2)
    z1 = tl.load(z1_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
    z = a[:, None] * z1 + (1.0 - a)[:, None] * E
    tl.store(z_ptr + row[:, None] * D + offs_d[None, :], z.to(z_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _p2_bwd(
    z1_ptr, lse_ptr, src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, dz_ptr, dz1_ptr, dlse_ptr, dE_ptr, dqg_ptr,
    B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b = pid // NTB
    offs_t = (pid % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    dmask = offs_d < D
    m2 = tmask[:, None] & dmask[None, :]
    K = tl.load(ks_ptr + r)
    qg = tl.load(qg_ptr + r * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    E = _conv_tile(src_ptr, W_ptr, doc_ptr, 0, r, b, offs_t, offs_d, tmask, dmask, doc_t, K, B, T, D, M, KMAX, HAS_DOC)
    rinv = tl.rsqrt(tl.sum(E * E, 1) / D + eps)
    l2 = tl.sum(E * qg[None, :], 1) * rinv
    row = (r * B + b).to(tl.int64) * T + offs_t
    ptrs = row[:, None] * D + offs_d[None, :]
    lse = tl.load(lse_ptr + row, mask=tmask, other=0.0)
    a = tl.sigmoid(lse - l2)
    z1 = tl.load(z1_ptr + ptrs, mask=m2, other=0.0)
    dz = tl.load(dz_ptr + ptrs, mask=m2, other=0.0).to(tl.float32)
    tl.store(dz1_ptr + ptrs, a[:, None] * dz, mask=m2)
    x = a * (1.0 - a) * tl.sum(dz * (z1 - E), 1)  # dL/d(lse1 - l2)
    tl.store(dlse_ptr + row, x, mask=tmask)
    a1 = tl.where(tmask, -x * rinv, 0.0)
    a2 = -a1 * l2 * rinv / D
    dE = (1.0 - a)[:, None] * dz + a1[:, None] * qg[None, :] + a2[:, None] * E
    tl.store(dE_ptr + ptrs, dE, mask=m2)
    tl.store(dqg_ptr + (r * B * NTB + pid) * D + offs_d, tl.sum(a1[:, None] * E, 0), mask=dmask)


def _geometry(B: int, T: int, D: int, block_t: int | None):
    bt = block_t or BLOCK_T_DEFAULT
    return bt, triton.next_power_of_2(D), triton.cdiv(T, bt)


def _doc(doc_ids_BT: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if doc_ids_BT is None:
        return torch.zeros(1, dtype=torch.int32, device=like.device), False
    return doc_ids_BT.to(device=like.device, dtype=torch.int32).contiguous(), True


def _conv_backward(src, W, ks, doc, has_doc, dE, block_t):
    S, B, T, D = src.shape
    M, KMAX = W.shape[1], W.shape[2]
    bt, bd, ntb = _geometry(B, T, D, block_t)
    ds = torch.empty(S, B, T, D, dtype=torch.float32, device=src.device)
    dW_parts = torch.zeros(S, M, KMAX, B * ntb, D, dtype=torch.float32, device=src.device)
    _conv_bwd[(B * ntb, S)](src, W, ks, doc, dE, ds, dW_parts, B, T, D, M, KMAX, ntb, HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd)
    return ds, dW_parts.sum(3)


class Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_SBTD, W_SMKD, qg_QMD, ks_M, doc_ids_BT, eps, block_t):
        src, W, qg = src_SBTD.contiguous(), W_SMKD.float().contiguous(), qg_QMD.float().contiguous()
        S, B, T, D = src.shape
        Q, M = qg.shape[:2]
        bt, bd, ntb = _geometry(B, T, D, block_t)
        doc, has_doc = _doc(doc_ids_BT, src)
        z1 = torch.empty(Q, M, B, T, D, dtype=torch.float32, device=src.device)
        lse = torch.empty(Q, M, B, T, dtype=torch.float32, device=src.device)
        _p1_fwd[(B * ntb, M, Q)](
            src, W, ks_M, qg, doc, z1, lse, S, B, T, D, M, W.shape[2], ntb, eps, HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd
        )
        ctx.save_for_backward(src, W, qg, ks_M, doc, lse)
        ctx.meta = (has_doc, eps, block_t, src_SBTD.dtype, W_SMKD.dtype, qg_QMD.dtype)
        return z1, lse

    @staticmethod
    def backward(ctx, dz1, dlse):
        src, W, qg, ks, doc, lse = ctx.saved_tensors
        has_doc, eps, block_t, sdt, wdt, qdt = ctx.meta
        S, B, T, D = src.shape
        Q, M = qg.shape[:2]
        bt, bd, ntb = _geometry(B, T, D, block_t)
        dz1 = torch.zeros_like(lse).unsqueeze(-1).expand(Q, M, B, T, D).contiguous() if dz1 is None else dz1.float().contiguous()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
        dE = torch.zeros(S, M, B, T, D, dtype=torch.float32, device=src.device)
        dqg_parts = torch.empty(Q, M, B * ntb, D, dtype=torch.float32, device=src.device)
        _p1_bwd[(B * ntb, M)](
            src,
            W,
            ks,
            qg,
            doc,
            lse,
            dz1,
            dlse,
            dE,
            dqg_parts,
            S,
            Q,
            B,
            T,
            D,
            M,
            W.shape[2],
            ntb,
            eps,
            HAS_DOC=has_doc,
            BLOCK_T=bt,
            BLOCK_D=bd,
        )
        ds, dW = _conv_backward(src, W, ks, doc, has_doc, dE, block_t)
        return ds.to(sdt), dW.to(wdt), dqg_parts.sum(2).to(qdt), None, None, None, None


class Phase2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z1_MBTD, lse_MBT, partial_BTD, W_MKD, qg_MD, ks_M, doc_ids_BT, eps, block_t):
        z1, lse = z1_MBTD.float().contiguous(), lse_MBT.float().contiguous()
        src, W, qg = partial_BTD.unsqueeze(0).contiguous(), W_MKD.float().unsqueeze(0).contiguous(), qg_MD.float().contiguous()
        _, B, T, D = src.shape
        M = qg.shape[0]
        bt, bd, ntb = _geometry(B, T, D, block_t)
        doc, has_doc = _doc(doc_ids_BT, src)
        z = torch.empty(M, B, T, D, dtype=partial_BTD.dtype, device=src.device)
        _p2_fwd[(B * ntb, M)](z1, lse, src, W, ks_M, qg, doc, z, B, T, D, M, W.shape[2], ntb, eps, HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd)
        ctx.save_for_backward(z1, lse, src, W, qg, ks_M, doc)
        ctx.meta = (has_doc, eps, block_t, partial_BTD.dtype, W_MKD.dtype, qg_MD.dtype)
        return z

    @staticmethod
    def backward(ctx, dz):
        z1, lse, src, W, qg, ks, doc = ctx.saved_tensors
        has_doc, eps, block_t, sdt, wdt, qdt = ctx.meta
        _, B, T, D = src.shape
        M = qg.shape[0]
        bt, bd, ntb = _geometry(B, T, D, block_t)
        dz = dz.contiguous()
        dz1 = torch.empty_like(z1)
        dlse = torch.empty_like(lse)
        dE = torch.empty(1, M, B, T, D, dtype=torch.float32, device=src.device)
        dqg_parts = torch.empty(M, B * ntb, D, dtype=torch.float32, device=src.device)
        _p2_bwd[(B * ntb, M)](
            z1,
            lse,
            src,
            W,
            ks,
            qg,
            doc,
            dz,
            dz1,
            dlse,
            dE,
            dqg_parts,
            B,
            T,
            D,
            M,
            W.shape[2],
            ntb,
            eps,
            HAS_DOC=has_doc,
            BLOCK_T=bt,
            BLOCK_D=bd,
        )
        ds, dW = _conv_backward(src, W, ks, doc, has_doc, dE, block_t)
        return dz1, dlse, ds[0].to(sdt), dW[0].to(wdt), dqg_parts.sum(1).to(qdt), None, None, None, None


def phase1(src_SBTD, W_SMKD, qg_QMD, ks_M, doc_ids_BT=None, eps=1e-6, block_t=None):
    """(z1_QMBTD fp32, lse_QMBT fp32) of Q targets over the stacked completed sources."""
    return Phase1.apply(src_SBTD, W_SMKD, qg_QMD, ks_M, doc_ids_BT, eps, block_t)


def phase2(z1_MBTD, lse_MBT, partial_BTD, W_MKD, qg_MD, ks_M, doc_ids_BT=None, eps=1e-6, block_t=None):
    """z_MBTD (partial's dtype) of one target: phase 1 merged with the partial source."""
    return Phase2.apply(z1_MBTD, lse_MBT, partial_BTD, W_MKD, qg_MD, ks_M, doc_ids_BT, eps, block_t)


def stacked_weights(banks, M: int, D: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_SMKD fp32, ks_M int32) for a list of banks (all share the kernel sizes)."""
    ks = [1] + [w.shape[0] for w in banks[0].weights] if banks[0].conv else [1] * M
    K = max(ks)
    eye = torch.zeros(K, D, dtype=torch.float32, device=like.device)
    eye[0] = 1.0
    rows = []
    for bank in banks:
        streams = [eye] + [torch.nn.functional.pad(w.float(), (0, 0, 0, K - w.shape[0])) for w in bank.weights] if bank.conv else [eye] * M
        rows.append(torch.stack(streams))
    return torch.stack(rows), torch.tensor(ks, dtype=torch.int32, device=like.device)


def target_forward(target, sources, partial, banks, doc_ids_BT, M: int, block_t: int | None = None) -> torch.Tensor:
    """``h_BTD`` of one target through the fused kernels (phase 1 with Q = 1, phase 2, torch fusion)."""
    D = sources[0].shape[-1]
    qg = target.qg()
    W, ks = stacked_weights(banks[: len(sources)], M, D, sources[0])
    z1, lse = phase1(torch.stack(sources), W, qg.unsqueeze(0), ks, doc_ids_BT, target.eps, block_t)
    if partial is None:
        z = z1[0].to(sources[0].dtype)
    else:
        Wp, ksp = stacked_weights([banks[len(sources)]], M, D, partial)
        z = phase2(z1[0], lse[0], partial, Wp[0], qg, ksp, doc_ids_BT, target.eps, block_t)
    return target.fuse(z)
