"""Fused Triton kernels of Block MSAR depth attention (``residual.kernel: triton``).

Legend: Q targets (queries), S sources, M streams, K taps (KMAX: the widest), B batch, T sequence,
D d_model, C = ceil(D / BLOCK_D) channel chunks.

Conv weights arrive as one padded tensor ``W_SMKD`` (fp32; stream 0 is the identity: one tap of 1)
with the per-stream tap counts ``ks_M``; ``expansion: none`` is every stream the identity.

Every kernel is tiled over D: a program owns ``BLOCK_T`` tokens and walks the channels in chunks of
``BLOCK_D`` (the launcher picks it, <= 128, so a program holds a few 16 x 128 fp32 tiles whatever
d_model is: no register spills at any width; ``scripts/triton_compile_table.py`` checks it for
sm_90). A softmax over depth needs the full-width reductions before it can weigh any chunk, so the
kernels make two passes over the sources: pass A computes the per-token reductions (E.E, E.qg; in
backward dz.E) and the logits, kept in a small fp32 scratch of ``S`` values per token, pass B the
chunked weighted sums. Programs are numbered stream-fastest (``pid = r + M * (q + Q * tile)``), so
the M stream programs (and the Q targets) of one token tile run side by side and read the same
source tile through L2 instead of from memory M times.

* phase 1 (``phase1``): for Q targets and all M streams at once, the causal (document-masked) conv
  expansion of each completed source is computed in registers, chunk by chunk; only
  ``z1 = o / sum exp`` [Q,M,B,T,D] and ``lse`` [Q,M,B,T] are outputs (plus the logits and RMS
  scales, [Q,M,S,B,T] each, kept for backward). The expanded streams never reach memory.
  The model calls it once per block (:func:`block_target_forward`): Q = the block's targets in
  this process, so each completed source is read once per block, forward and backward.
* phase 1 backward: a stats kernel (per target and stream) turns the saved logits and dz.E into the
  softmax-backward coefficients (p, d logit * rinv, the RMS term) [Q,M,S,B,T] and the pseudo-query
  gradient; then, one source at a time, a kernel sums the expanded-stream gradient over the Q targets
  in registers (``dE`` [M,B,T,D] fp32 for one source: the only D-sized scratch, S times smaller than
  all sources at once), and two kernels fold it back through the transposed conv into the source's
  gradient (stored in the source's dtype) and the conv weights' gradient (accumulated over token
  tiles in registers; a few partials per weight, summed in torch: deterministic, no atomics).
* phase 2 (``phase2``): per target, the partial source's expansion and logit fused with the
  online-softmax merge ``z = sigmoid(lse1 - l2) z1 + sigmoid(l2 - lse1) E2``.

All math is fp32 (inputs are upcast right after each load; bf16 is stored only at the end). The
fusion mixer stays in torch: its input ``z`` [M,B,T,D] is what the gate GEMM reads anyway.
Import this module only when Triton is installed; on CPU set ``TRITON_INTERPRET=1`` first.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from msar_train.kernels import lean

BLOCK_T_DEFAULT = 16
BLOCK_D_MAX = 128  # a 16 x 128 fp32 tile is 16 registers per thread at 4 warps
NUM_WARPS = 4
# Registers per thread the launcher allows (ptxas's .maxnreg). Left to itself ptxas holds the conv
# backward at 64 and spills a word there with bf16 and document masking; 128 is what the largest
# kernels use anyway and still lets four 4-warp programs share an SM's 64K registers.
MAX_REGISTERS = 128
DW_PROGRAMS = 2048  # the conv weight-gradient kernel splits its token tiles to reach about this many programs


@triton.jit
def _conv_chunk(base, W_ptr, doc_ptr, wrow, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC: tl.constexpr):
    """E[t, chunk] = sum_{delta<K} W[wrow + delta, chunk] * src[t - delta, chunk] (fp32); ``base`` is src[j, b]."""
    E = tl.zeros([offs_t.shape[0], offs_d.shape[0]], dtype=tl.float32)
    for delta in range(K):
        tt = offs_t - delta
        valid = tmask & (tt >= 0)
        if HAS_DOC:
            dd = tl.load(doc_ptr + b * T + tt, mask=valid, other=-1)
            valid = valid & (dd == doc_t)
        x = tl.load(base + tt[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(W_ptr + (wrow + delta) * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
        E += x * w[None, :]
    return E


@triton.jit
def _tile_ids(pid, M, Q, NTB, T, BLOCK_T: tl.constexpr):
    """(stream r, target q, batch b, token offsets, token mask) of a stream-fastest program id."""
    r = pid % M
    q = (pid // M) % Q
    tile = pid // (M * Q)
    offs_t = (tile % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    return r, q, tile, tile // NTB, offs_t, offs_t < T


@triton.jit
def _p1_fwd(
    src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, z_ptr, lse_ptr, L_ptr, rinv_ptr,
    S, Q, B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r, q, tile, b, offs_t, tmask = _tile_ids(tl.program_id(0), M, Q, NTB, T, BLOCK_T)
    K = tl.load(ks_ptr + r)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    m_i = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in range(S):  # pass A: full-width reductions, logits, online max / sum
        base = src_ptr + (j * B + b).to(tl.int64) * T * D
        ss = tl.zeros([BLOCK_T], dtype=tl.float32)
        dot = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            offs_d = c + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            E = _conv_chunk(base, W_ptr, doc_ptr, (j * M + r) * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
            qg = tl.load(qg_ptr + (q * M + r) * D + offs_d, mask=dmask, other=0.0)
            ss += tl.sum(E * E, 1)
            dot += tl.sum(E * qg[None, :], 1)
        rinv = tl.rsqrt(ss / D + eps)
        logit = dot * rinv
        stat = (((q * M + r) * S + j) * B + b).to(tl.int64) * T + offs_t
        tl.store(L_ptr + stat, logit, mask=tmask)
        tl.store(rinv_ptr + stat, rinv, mask=tmask)
        m_new = tl.maximum(m_i, logit)
        l_i = l_i * tl.exp(m_i - m_new) + tl.exp(logit - m_new)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    row = ((q * M + r) * B + b).to(tl.int64) * T + offs_t
    tl.store(lse_ptr + row, lse, mask=tmask)
    tl.debug_barrier()  # the logits this program stored are read back by other threads below
    for c in range(0, D, BLOCK_D):  # pass B: the softmax-weighted sum, one chunk at a time
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for j in range(S):
            stat = (((q * M + r) * S + j) * B + b).to(tl.int64) * T + offs_t
            p = tl.exp(tl.load(L_ptr + stat, mask=tmask, other=0.0) - lse)
            base = src_ptr + (j * B + b).to(tl.int64) * T * D
            E = _conv_chunk(base, W_ptr, doc_ptr, (j * M + r) * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
            acc += p[:, None] * E
        tl.store(z_ptr + row[:, None] * D + offs_d[None, :], acc, mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _p1_stats(
    src_ptr, W_ptr, ks_ptr, doc_ptr, lse_ptr, L_ptr, rinv_ptr, dz_ptr, dlse_ptr, P_ptr, A1_ptr, A2_ptr, dqg_ptr,
    S, Q, B, T, D, M, KMAX, NTB,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per (target, stream, tile): p, a1 = d logit * rinv, a2 = -a1 * logit * rinv / D, and dqg partials."""
    r, q, tile, b, offs_t, tmask = _tile_ids(tl.program_id(0), M, Q, NTB, T, BLOCK_T)
    K = tl.load(ks_ptr + r)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    row = ((q * M + r) * B + b).to(tl.int64) * T + offs_t
    lse = tl.load(lse_ptr + row, mask=tmask, other=0.0)
    dl = tl.load(dlse_ptr + row, mask=tmask, other=0.0)
    gsum = tl.zeros([BLOCK_T], dtype=tl.float32)  # <dz, z1> = sum_j p_j <dz, E_j>
    for j in range(S):  # pass A: <dz, E_j> over the full width
        base = src_ptr + (j * B + b).to(tl.int64) * T * D
        dzE = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            offs_d = c + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            E = _conv_chunk(base, W_ptr, doc_ptr, (j * M + r) * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
            dz = tl.load(dz_ptr + row[:, None] * D + offs_d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
            dzE += tl.sum(dz * E, 1)
        stat = (((q * M + r) * S + j) * B + b).to(tl.int64) * T + offs_t
        p = tl.where(tmask, tl.exp(tl.load(L_ptr + stat, mask=tmask, other=0.0) - lse), 0.0)
        gsum += p * dzE
        tl.store(A1_ptr + stat, dzE, mask=tmask)  # parked here until gsum is complete
    tl.debug_barrier()
    for j in range(S):  # the coefficients, from per-token scalars only
        stat = (((q * M + r) * S + j) * B + b).to(tl.int64) * T + offs_t
        logit = tl.load(L_ptr + stat, mask=tmask, other=0.0)
        rinv = tl.load(rinv_ptr + stat, mask=tmask, other=0.0)
        p = tl.where(tmask, tl.exp(logit - lse), 0.0)
        a1 = p * (tl.load(A1_ptr + stat, mask=tmask, other=0.0) - gsum + dl) * rinv
        tl.store(P_ptr + stat, p, mask=tmask)
        tl.store(A1_ptr + stat, a1, mask=tmask)
        tl.store(A2_ptr + stat, -a1 * logit * rinv / D, mask=tmask)
    tl.debug_barrier()
    for c in range(0, D, BLOCK_D):  # pass B: dqg = sum_t sum_j a1_j E_j, one chunk at a time
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        dqg = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(S):
            stat = (((q * M + r) * S + j) * B + b).to(tl.int64) * T + offs_t
            a1 = tl.load(A1_ptr + stat, mask=tmask, other=0.0)
            base = src_ptr + (j * B + b).to(tl.int64) * T * D
            E = _conv_chunk(base, W_ptr, doc_ptr, (j * M + r) * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
            dqg += tl.sum(a1[:, None] * E, 0)
        tl.store(dqg_ptr + ((q * M + r) * B * NTB + tile).to(tl.int64) * D + offs_d, dqg, mask=dmask)


@triton.jit
def _p1_dE(
    src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, dz_ptr, P_ptr, A1_ptr, A2_ptr, dE_ptr,
    j, S, Q, B, T, D, M, KMAX, NTB,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dE[r] of source j = sum_q p_qj dz_q + a1_qj qg_q + a2_qj E_j, summed over q in registers."""
    r, _q, tile, b, offs_t, tmask = _tile_ids(tl.program_id(0), M, 1, NTB, T, BLOCK_T)
    K = tl.load(ks_ptr + r)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    base = src_ptr + (j * B + b).to(tl.int64) * T * D
    out = (r * B + b).to(tl.int64) * T + offs_t
    for c in range(0, D, BLOCK_D):
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        m2 = tmask[:, None] & dmask[None, :]
        E = _conv_chunk(base, W_ptr, doc_ptr, (j * M + r) * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
        dE = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for q in range(Q):
            stat = (((q * M + r) * S + j) * B + b).to(tl.int64) * T + offs_t
            p = tl.load(P_ptr + stat, mask=tmask, other=0.0)
            a1 = tl.load(A1_ptr + stat, mask=tmask, other=0.0)
            a2 = tl.load(A2_ptr + stat, mask=tmask, other=0.0)
            row = ((q * M + r) * B + b).to(tl.int64) * T + offs_t
            dz = tl.load(dz_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
            qg = tl.load(qg_ptr + (q * M + r) * D + offs_d, mask=dmask, other=0.0)
            dE += p[:, None] * dz + a1[:, None] * qg[None, :] + a2[:, None] * E
        tl.store(dE_ptr + out[:, None] * D + offs_d[None, :], dE, mask=m2)


@triton.jit
def _conv_ds(
    W_ptr, ks_ptr, doc_ptr, dE_ptr, ds_ptr,
    j, B, T, D, M, KMAX, NTB,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """ds[j, t] = sum_r sum_delta W[j,r,delta] dE[r, t+delta] (the transposed, anti-causal conv)."""
    tile = tl.program_id(0)
    b = tile // NTB
    offs_t = (tile % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    out = (j * B + b).to(tl.int64) * T + offs_t
    for c in range(0, D, BLOCK_D):
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        ds = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for r in range(M):
            K = tl.load(ks_ptr + r)
            dEb = dE_ptr + (r * B + b).to(tl.int64) * T * D
            for delta in range(K):
                w = tl.load(W_ptr + ((j * M + r) * KMAX + delta) * D + offs_d, mask=dmask, other=0.0)
                tt = offs_t + delta
                valid = tmask & (tt < T)
                if HAS_DOC:
                    dd = tl.load(doc_ptr + b * T + tt, mask=valid, other=-1)
                    valid = valid & (dd == doc_t)
                g = tl.load(dEb + tt[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
                ds += w[None, :] * g
        tl.store(ds_ptr + out[:, None] * D + offs_d[None, :], ds.to(ds_ptr.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _conv_dw(
    src_ptr, ks_ptr, doc_ptr, dE_ptr, dW_ptr,
    j, S, B, T, D, M, KMAX, NTB, NSPLIT,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dW[split, j, r, delta, chunk] = sum over this split's token tiles of dE[r, t] * src[j, t - delta]."""
    rd = tl.program_id(0)
    r = rd // KMAX
    delta = rd % KMAX
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    split = tl.program_id(2)
    K = tl.load(ks_ptr + r)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if delta < K:
        for tile in range(split, B * NTB, NSPLIT):
            b = tile // NTB
            offs_t = (tile % NTB) * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = offs_t < T
            ts = offs_t - delta
            vs = tmask & (ts >= 0)
            if HAS_DOC:
                doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
                dd = tl.load(doc_ptr + b * T + ts, mask=vs, other=-1)
                vs = vs & (dd == doc_t)
            g = tl.load(
                dE_ptr + ((r * B + b).to(tl.int64) * T + offs_t)[:, None] * D + offs_d[None, :],
                mask=tmask[:, None] & dmask[None, :],
                other=0.0,
            )
            x = tl.load(
                src_ptr + ((j * B + b).to(tl.int64) * T + ts)[:, None] * D + offs_d[None, :], mask=vs[:, None] & dmask[None, :], other=0.0
            )
            acc += g * x.to(tl.float32)
    tl.store(dW_ptr + ((((split * S + j) * M + r) * KMAX + delta) * D + offs_d).to(tl.int64), tl.sum(acc, 0), mask=dmask)


@triton.jit
def _p2_reduce(
    z1_ptr,
    dz_ptr,
    src_ptr,
    W_ptr,
    qg_ptr,
    doc_ptr,
    r,
    b,
    row,
    offs_t,
    tmask,
    doc_t,
    K,
    T,
    D,
    KMAX,
    HAS_DOC: tl.constexpr,
    WITH_DZ: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Full-width E.E, E.qg and (backward) dz.(z1 - E) of the partial source's stream r."""
    ss = tl.zeros([offs_t.shape[0]], dtype=tl.float32)
    dot = tl.zeros([offs_t.shape[0]], dtype=tl.float32)
    sdz = tl.zeros([offs_t.shape[0]], dtype=tl.float32)
    base = src_ptr + b.to(tl.int64) * T * D
    for c in range(0, D, BLOCK_D):
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        E = _conv_chunk(base, W_ptr, doc_ptr, r * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
        qg = tl.load(qg_ptr + r * D + offs_d, mask=dmask, other=0.0)
        ss += tl.sum(E * E, 1)
        dot += tl.sum(E * qg[None, :], 1)
        if WITH_DZ:
            m2 = tmask[:, None] & dmask[None, :]
            z1 = tl.load(z1_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
            dz = tl.load(dz_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
            sdz += tl.sum(dz * (z1 - E), 1)
    return ss, dot, sdz


@triton.jit
def _p2_fwd(
    z1_ptr, lse_ptr, src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, z_ptr,
    B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r, _q, tile, b, offs_t, tmask = _tile_ids(tl.program_id(0), M, 1, NTB, T, BLOCK_T)
    K = tl.load(ks_ptr + r)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    row = (r * B + b).to(tl.int64) * T + offs_t
    ss, dot, _ = _p2_reduce(
        z1_ptr, z1_ptr, src_ptr, W_ptr, qg_ptr, doc_ptr, r, b, row, offs_t, tmask, doc_t, K, T, D, KMAX, HAS_DOC, False, BLOCK_D
    )
    l2 = dot * tl.rsqrt(ss / D + eps)
    a = tl.sigmoid(tl.load(lse_ptr + row, mask=tmask, other=0.0) - l2)
    base = src_ptr + b.to(tl.int64) * T * D
    for c in range(0, D, BLOCK_D):
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        m2 = tmask[:, None] & dmask[None, :]
        E = _conv_chunk(base, W_ptr, doc_ptr, r * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
        z1 = tl.load(z1_ptr + row[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        z = a[:, None] * z1 + (1.0 - a)[:, None] * E
        tl.store(z_ptr + row[:, None] * D + offs_d[None, :], z.to(z_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _p2_bwd(
    z1_ptr, lse_ptr, src_ptr, W_ptr, ks_ptr, qg_ptr, doc_ptr, dz_ptr, dz1_ptr, dlse_ptr, dE_ptr, dqg_ptr,
    B, T, D, M, KMAX, NTB, eps,
    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r, _q, tile, b, offs_t, tmask = _tile_ids(tl.program_id(0), M, 1, NTB, T, BLOCK_T)
    K = tl.load(ks_ptr + r)
    doc_t = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * T + offs_t, mask=tmask, other=0)
    row = (r * B + b).to(tl.int64) * T + offs_t
    ss, dot, sdz = _p2_reduce(
        z1_ptr, dz_ptr, src_ptr, W_ptr, qg_ptr, doc_ptr, r, b, row, offs_t, tmask, doc_t, K, T, D, KMAX, HAS_DOC, True, BLOCK_D
    )
    rinv = tl.rsqrt(ss / D + eps)
    l2 = dot * rinv
    a = tl.sigmoid(tl.load(lse_ptr + row, mask=tmask, other=0.0) - l2)
    x = a * (1.0 - a) * sdz  # dL/d(lse1 - l2)
    tl.store(dlse_ptr + row, x, mask=tmask)
    a1 = tl.where(tmask, -x * rinv, 0.0)
    a2 = -a1 * l2 * rinv / D
    base = src_ptr + b.to(tl.int64) * T * D
    for c in range(0, D, BLOCK_D):
        offs_d = c + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        m2 = tmask[:, None] & dmask[None, :]
        ptrs = row[:, None] * D + offs_d[None, :]
        E = _conv_chunk(base, W_ptr, doc_ptr, r * KMAX, b, offs_t, offs_d, tmask, dmask, doc_t, K, T, D, HAS_DOC)
        dz = tl.load(dz_ptr + ptrs, mask=m2, other=0.0).to(tl.float32)
        qg = tl.load(qg_ptr + r * D + offs_d, mask=dmask, other=0.0)
        tl.store(dz1_ptr + ptrs, a[:, None] * dz, mask=m2)
        tl.store(dE_ptr + ptrs, (1.0 - a)[:, None] * dz + a1[:, None] * qg[None, :] + a2[:, None] * E, mask=m2)
        tl.store(dqg_ptr + (r * B * NTB + tile).to(tl.int64) * D + offs_d, tl.sum(a1[:, None] * E, 0), mask=dmask)


def launch_config(D: int, block_t: int | None = None, block_d: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) for width D: chunks of <= BLOCK_D_MAX channels at any d_model."""
    bt = block_t or BLOCK_T_DEFAULT
    bd = block_d or min(BLOCK_D_MAX, triton.next_power_of_2(D))
    if bd & (bd - 1) or bt & (bt - 1):
        raise ValueError(f"triton kernels: block_t ({bt}) and block_d ({bd}) must be powers of two")
    return bt, bd, NUM_WARPS


def _doc(doc_ids_BT: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if doc_ids_BT is None:
        return torch.zeros(1, dtype=torch.int32, device=like.device), False
    return doc_ids_BT.to(device=like.device, dtype=torch.int32).contiguous(), True


def _conv_backward_source(src, W, ks, doc, has_doc, dE, j, ds, dW_parts, bt, bd, nw):
    """Source j's gradient (into ds[j]) and its conv weights' gradient partials (into dW_parts[:, j])."""
    S, B, T, D = src.shape
    M, KMAX = W.shape[1], W.shape[2]
    ntb = triton.cdiv(T, bt)
    _conv_ds[(B * ntb,)](
        W, ks, doc, dE, ds, j, B, T, D, M, KMAX, ntb, HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd, num_warps=nw, maxnreg=MAX_REGISTERS
    )
    nsplit = dW_parts.shape[0]
    grid = (M * KMAX, triton.cdiv(D, bd), nsplit)
    _conv_dw[grid](
        src,
        ks,
        doc,
        dE,
        dW_parts,
        j,
        S,
        B,
        T,
        D,
        M,
        KMAX,
        ntb,
        nsplit,
        HAS_DOC=has_doc,
        BLOCK_T=bt,
        BLOCK_D=bd,
        num_warps=nw,
        maxnreg=MAX_REGISTERS,
    )


def _dw_splits(B: int, T: int, D: int, M: int, KMAX: int, bt: int, bd: int) -> int:
    per_split = M * KMAX * triton.cdiv(D, bd)
    return max(1, min(B * triton.cdiv(T, bt), triton.cdiv(DW_PROGRAMS, per_split)))


class Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_SBTD, W_SMKD, qg_QMD, ks_M, doc_ids_BT, eps, block_t, block_d):
        src, W, qg = src_SBTD.contiguous(), W_SMKD.float().contiguous(), qg_QMD.float().contiguous()
        S, B, T, D = src.shape
        Q, M = qg.shape[:2]
        bt, bd, nw = launch_config(D, block_t, block_d)
        ntb = triton.cdiv(T, bt)
        doc, has_doc = _doc(doc_ids_BT, src)
        z1 = torch.empty(Q, M, B, T, D, dtype=torch.float32, device=src.device)
        lse = torch.empty(Q, M, B, T, dtype=torch.float32, device=src.device)
        L = torch.empty(Q, M, S, B, T, dtype=torch.float32, device=src.device)
        rinv = torch.empty_like(L)
        _p1_fwd[(B * ntb * M * Q,)](
            src, W, ks_M, qg, doc, z1, lse, L, rinv, S, Q, B, T, D, M, W.shape[2], ntb, eps,
            HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd, num_warps=nw, maxnreg=MAX_REGISTERS,
        )  # fmt: skip
        ctx.save_for_backward(src, W, qg, ks_M, doc, lse, L, rinv)
        ctx.meta = (has_doc, bt, bd, nw, W_SMKD.dtype, qg_QMD.dtype)
        return z1, lse

    @staticmethod
    def backward(ctx, dz1, dlse):
        src, W, qg, ks, doc, lse, L, rinv = ctx.saved_tensors
        has_doc, bt, bd, nw, wdt, qdt = ctx.meta
        S, B, T, D = src.shape
        Q, M = qg.shape[:2]
        KMAX = W.shape[2]
        ntb = triton.cdiv(T, bt)
        dz1 = torch.zeros_like(lse).unsqueeze(-1).expand(Q, M, B, T, D).contiguous() if dz1 is None else dz1.float().contiguous()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
        P, A1, A2 = torch.empty_like(L), torch.empty_like(L), torch.empty_like(L)
        dqg_parts = torch.empty(Q, M, B * ntb, D, dtype=torch.float32, device=src.device)
        _p1_stats[(B * ntb * M * Q,)](
            src, W, ks, doc, lse, L, rinv, dz1, dlse, P, A1, A2, dqg_parts, S, Q, B, T, D, M, KMAX, ntb,
            HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd, num_warps=nw, maxnreg=MAX_REGISTERS,
        )  # fmt: skip
        dE = torch.empty(M, B, T, D, dtype=torch.float32, device=src.device)  # one source at a time
        ds = torch.empty_like(src)
        dW_parts = torch.zeros(_dw_splits(B, T, D, M, KMAX, bt, bd), S, M, KMAX, D, dtype=torch.float32, device=src.device)
        for j in range(S):
            _p1_dE[(B * ntb * M,)](
                src, W, ks, qg, doc, dz1, P, A1, A2, dE, j, S, Q, B, T, D, M, KMAX, ntb,
                HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd, num_warps=nw, maxnreg=MAX_REGISTERS,
            )  # fmt: skip
            _conv_backward_source(src, W, ks, doc, has_doc, dE, j, ds, dW_parts, bt, bd, nw)
        return ds, dW_parts.sum(0).to(wdt), dqg_parts.sum(2).to(qdt), None, None, None, None, None


class Phase2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z1_MBTD, lse_MBT, partial_BTD, W_MKD, qg_MD, ks_M, doc_ids_BT, eps, block_t, block_d):
        z1, lse = z1_MBTD.float().contiguous(), lse_MBT.float().contiguous()
        src, W, qg = partial_BTD.unsqueeze(0).contiguous(), W_MKD.float().unsqueeze(0).contiguous(), qg_MD.float().contiguous()
        _, B, T, D = src.shape
        M = qg.shape[0]
        bt, bd, nw = launch_config(D, block_t, block_d)
        ntb = triton.cdiv(T, bt)
        doc, has_doc = _doc(doc_ids_BT, src)
        z = torch.empty(M, B, T, D, dtype=partial_BTD.dtype, device=src.device)
        _p2_fwd[(B * ntb * M,)](
            z1,
            lse,
            src,
            W,
            ks_M,
            qg,
            doc,
            z,
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
            num_warps=nw,
            maxnreg=MAX_REGISTERS,
        )
        ctx.save_for_backward(z1, lse, src, W, qg, ks_M, doc)
        ctx.meta = (has_doc, eps, bt, bd, nw, W_MKD.dtype, qg_MD.dtype)
        return z

    @staticmethod
    def backward(ctx, dz):
        z1, lse, src, W, qg, ks, doc = ctx.saved_tensors
        has_doc, eps, bt, bd, nw, wdt, qdt = ctx.meta
        _, B, T, D = src.shape
        M, KMAX = qg.shape[0], W.shape[2]
        ntb = triton.cdiv(T, bt)
        dz = dz.contiguous()
        dz1 = torch.empty_like(z1)
        dlse = torch.empty_like(lse)
        dE = torch.empty(M, B, T, D, dtype=torch.float32, device=src.device)
        dqg_parts = torch.empty(M, B * ntb, D, dtype=torch.float32, device=src.device)
        _p2_bwd[(B * ntb * M,)](
            z1, lse, src, W, ks, qg, doc, dz, dz1, dlse, dE, dqg_parts, B, T, D, M, KMAX, ntb, eps,
            HAS_DOC=has_doc, BLOCK_T=bt, BLOCK_D=bd, num_warps=nw, maxnreg=MAX_REGISTERS,
        )  # fmt: skip
        ds = torch.empty_like(src)
        dW_parts = torch.zeros(_dw_splits(B, T, D, M, KMAX, bt, bd), 1, M, KMAX, D, dtype=torch.float32, device=src.device)
        _conv_backward_source(src, W, ks, doc, has_doc, dE, 0, ds, dW_parts, bt, bd, nw)
        return dz1, dlse, ds[0], dW_parts.sum(0)[0].to(wdt), dqg_parts.sum(1).to(qdt), None, None, None, None, None


def phase1(src_SBTD, W_SMKD, qg_QMD, ks_M, doc_ids_BT=None, eps=1e-6, block_t=None, block_d=None):
    """(z1_QMBTD fp32, lse_QMBT fp32) of Q targets over the stacked completed sources."""
    return Phase1.apply(src_SBTD, W_SMKD, qg_QMD, ks_M, doc_ids_BT, eps, block_t, block_d)


def phase2(z1_MBTD, lse_MBT, partial_BTD, W_MKD, qg_MD, ks_M, doc_ids_BT=None, eps=1e-6, block_t=None, block_d=None):
    """z_MBTD (partial's dtype) of one target: phase 1 merged with the partial source."""
    return Phase2.apply(z1_MBTD, lse_MBT, partial_BTD, W_MKD, qg_MD, ks_M, doc_ids_BT, eps, block_t, block_d)


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
    return _merge_and_fuse(target, z1[0], lse[0], sources, partial, banks, doc_ids_BT, M, block_t)


def _merge_and_fuse(target, z1_MBTD, lse_MBT, sources, partial, banks, doc_ids_BT, M: int, block_t) -> torch.Tensor:
    """``h_BTD`` from one target's phase-1 output: phase 2 with its partial (if any), then the fusion."""
    if partial is None:
        z = z1_MBTD.to(sources[0].dtype)
    else:
        Wp, ksp = stacked_weights([banks[len(sources)]], M, partial.shape[-1], partial)
        z = phase2(z1_MBTD, lse_MBT, partial, Wp[0], target.qg(), ksp, doc_ids_BT, target.eps, block_t)
    return lean.fuse(target, z)


class BlockPhase1:
    """Phase 1 of one block in one forward on the Triton path: ``z1`` and ``lse`` of all its local
    targets from one ``phase1`` launch (Q = the block's targets in this process), handed out per target.

    The per-target views come from one ``unbind``, so autograd gathers the Q targets' gradients into one
    ``dz1 [Q,M,B,T,D]`` (a stack, not Q zero-padded copies) and ``Phase1.backward`` runs once for the
    block: the stats kernel over all Q, then per completed source one ``_p1_dE`` pass that sums the Q
    targets in registers and one transposed-conv pass. Sources are read once per block instead of Q
    times, forward and backward."""

    def __init__(self, peers: list, sources: list[torch.Tensor], doc_ids_BT, z1_QMBTD, lse_QMBT):
        self.s_refs = [weakref.ref(s) for s in sources]
        self.doc_ref = None if doc_ids_BT is None else weakref.ref(doc_ids_BT)
        self.n_peers = len(peers)
        self.z1 = z1_QMBTD.unbind(0)
        self.lse = lse_QMBT.unbind(0)
        self.read_by: set[int] = set()

    def matches(self, sources: list[torch.Tensor], doc_ids_BT) -> bool:
        same_doc = doc_ids_BT is None if self.doc_ref is None else self.doc_ref() is doc_ids_BT
        return same_doc and len(sources) == len(self.s_refs) and all(r() is s for r, s in zip(self.s_refs, sources))


def block_target_forward(
    target, peers: list, sources, partial, banks, doc_ids_BT, M: int, groups: dict, block_t: int | None = None
) -> torch.Tensor:
    """``h_BTD`` of ``target`` (one of ``peers``, its block's targets in this process) with phase 1 run
    once per block: the first of the block's targets to read launches it for all peers (their stacked
    pseudo-queries), the others take their share. ``groups`` (one per model) holds each block's
    :class:`BlockPhase1` until its last peer has read. Equal to :func:`target_forward` per target."""
    key = id(peers)
    g = groups.get(key)
    if g is None or id(target) in g.read_by or not g.matches(sources, doc_ids_BT):
        D = sources[0].shape[-1]
        W, ks = stacked_weights(banks[: len(sources)], M, D, sources[0])
        qg_QMD = torch.stack([t.qg() for t in peers])
        z1, lse = phase1(torch.stack(sources), W, qg_QMD, ks, doc_ids_BT, target.eps, block_t)
        g = groups[key] = BlockPhase1(peers, sources, doc_ids_BT, z1, lse)
    q = peers.index(target)
    g.read_by.add(id(target))
    if len(g.read_by) == g.n_peers:
        del groups[key]  # every peer has its share: the views live on in the targets' graphs only
    return _merge_and_fuse(target, g.z1[q], g.lse[q], sources, partial, banks, doc_ids_BT, M, block_t)
