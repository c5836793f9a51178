"""Fused CPU loops of the lean torch path (``kernels/lean.py``, ``kernels/lean_block.py``).

On CPU the lean path's cost is not arithmetic but passes over ``[B,T,D]`` tensors: every torch op
reads and writes whole tensors (a K-tap conv is K multiply-adds over the source, a weighted sum of
S sources 3S tensor passes). These few loops do the same math in one pass each:

* ``conv_forward``: a source's C conv streams (document-masked) and the sums of squares of all
  M = C + 1 streams per token (for the key RMS), one read of the source per token row;
* ``conv_backward``: the transposed conv: the source's gradient and every conv weight's gradient
  from the streams' gradient, one pass (weight gradients accumulated per thread, then summed in a
  fixed order: deterministic for a given thread count);
* ``weighted_sum``: ``z_r = sum_j p[j, r] E_jr`` over S sources for every stream, optionally merged
  with a partial (``z = a z1 + (1 - a) E2``) and returning z1 too;
* ``phase1_dots`` / ``phase1_grad``: phase 1's backward for one (source, stream) and Q targets: the
  dot products ``<dz1_q, E>`` in one read of E, then the stream gradient
  ``dE = sum_q a1_q qg_q + a2 E + sum_q P_q dz1_q`` and ``dqg_q += sum_n a1_q E`` in one more.

They are plain C (no torch headers: a build takes about a second), compiled on first use with the
system's C compiler (``$CC``, default ``cc``) and OpenMP into a cache directory
(``$MSAR_NATIVE_CACHE``, default ``~/.cache/msar_train``), and called through ctypes on tensors'
data pointers. fp32 and fp64 only, contiguous CPU tensors. Where they do not apply (another device
or dtype, no compiler, ``MSAR_NATIVE=0``) the lean path runs its torch ops: same math, tested
against each other in ``tests/unit/test_cpu_native.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_HEADER = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

static int omp_tid(void) { return omp_get_thread_num(); }
static int omp_nth(void) { return omp_get_num_threads(); }

"""

# The kernels, written once for ``scalar_t``; ``_SUF`` names the instance (f32, f64).
_TEMPLATE = r"""
/* out: C streams [C][B][T][D]; sq: sums of squares [C+1][B][T] (stream 0 = the source). */
void conv_forward_SUF(const scalar_t* restrict s, int64_t B, int64_t TT, int64_t D, int64_t C,
                        const scalar_t* const* w, const int64_t* K, const int64_t* doc, scalar_t* restrict out,
                        scalar_t* restrict sq, int nt) {
  int64_t N = B * TT;
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t n = 0; n < N; n++) {
    int64_t b = n / TT, t = n % TT;
    const scalar_t* x = s + n * D;
    scalar_t acc0 = 0;
    _Pragma("omp simd reduction(+:acc0)") for (int64_t d = 0; d < D; d++) acc0 += x[d] * x[d];
    sq[n] = acc0;
    for (int64_t c = 0; c < C; c++) {
      scalar_t* y = out + (c * N + n) * D;
      const scalar_t* wc = w[c];
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) y[d] = wc[d] * x[d];
      for (int64_t k = 1; k < K[c] && k <= t; k++) {
        if (doc && doc[b * TT + t] != doc[b * TT + t - k]) continue;
        const scalar_t* xs = x - k * D;
        const scalar_t* wk = wc + k * D;
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) y[d] += wk[d] * xs[d];
      }
      scalar_t acc = 0;
      _Pragma("omp simd reduction(+:acc)") for (int64_t d = 0; d < D; d++) acc += y[d] * y[d];
      sq[(c + 1) * N + n] = acc;
    }
  }
}
/* ds [B][T][D] (overwritten); dw[c] [K_c][D] (overwritten). */
void conv_backward_SUF(const scalar_t* restrict s, int64_t B, int64_t TT, int64_t D, int64_t C,
                         const scalar_t* const* w, const int64_t* K, const int64_t* doc,
                         const scalar_t* restrict dE, scalar_t* restrict ds, scalar_t* const* dw, int nt) {
  int64_t N = B * TT, KS = 0;
  for (int64_t c = 0; c < C; c++) KS += K[c];
  scalar_t* part = (scalar_t*)calloc((size_t)nt * KS * D, sizeof(scalar_t));
  _Pragma("omp parallel num_threads(nt)")
  {
    int tid = omp_tid(), nth = omp_nth();
    scalar_t* acc = part + (int64_t)tid * KS * D;
    int64_t lo = N * tid / nth, hi = N * (tid + 1) / nth;
    for (int64_t n = lo; n < hi; n++) {
      int64_t b = n / TT, t = n % TT;
      const scalar_t* x = s + n * D;
      scalar_t* g = ds + n * D;
      memset(g, 0, sizeof(scalar_t) * D);
      int64_t off = 0;
      for (int64_t c = 0; c < C; c++) {
        const scalar_t* e = dE + (c * N + n) * D;
        const scalar_t* wc = w[c];
        for (int64_t k = 0; k < K[c]; k++) {
          /* ds[t] += w[k] * dE[t + k] (same document); dw[k] += dE[t] * s[t - k] */
          if (t + k < TT && !(doc && doc[b * TT + t + k] != doc[b * TT + t])) {
            const scalar_t* ef = e + k * D; const scalar_t* wk = wc + k * D;
            _Pragma("omp simd") for (int64_t d = 0; d < D; d++) g[d] += wk[d] * ef[d];
          }
          if (k <= t && !(doc && doc[b * TT + t] != doc[b * TT + t - k])) {
            const scalar_t* xs = x - k * D; scalar_t* a = acc + (off + k) * D;
            _Pragma("omp simd") for (int64_t d = 0; d < D; d++) a[d] += e[d] * xs[d];
          }
        }
        off += K[c];
      }
    }
  }
  int64_t off = 0;
  for (int64_t c = 0; c < C; c++) {
    for (int64_t i = 0; i < K[c] * D; i++) {
      scalar_t v = 0;
      for (int th = 0; th < nt; th++) v += part[(int64_t)th * KS * D + off * D + i];
      dw[c][i] = v;
    }
    off += K[c];
  }
  free(part);
}
/* logits[q][n] = <E[n], v_q> for Q vectors (the pseudo-queries), one read of E. */
void row_dots_SUF(int64_t Q, int64_t N, int64_t D, const scalar_t* restrict E, const scalar_t* restrict V,
                  scalar_t* restrict out, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t n = 0; n < N; n++) {
    const scalar_t* e = E + n * D;
    for (int64_t q = 0; q < Q; q++) {
      const scalar_t* v = V + q * D;
      scalar_t acc = 0;
      _Pragma("omp simd reduction(+:acc)") for (int64_t d = 0; d < D; d++) acc += e[d] * v[d];
      out[q * N + n] = acc;
    }
  }
}

/* z[r] = sum_j p[j][r] E[j*M + r] (+ merge: z = a z1 + (1 - a) E2[r]); z1 out optional. */
void weighted_sum_SUF(int64_t S, int64_t M, int64_t N, int64_t D, const scalar_t* const* E,
                        const scalar_t* restrict p, const scalar_t* restrict a, const scalar_t* const* E2,
                        scalar_t* restrict z, scalar_t* restrict z1, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t i = 0; i < M * N; i++) {
    int64_t r = i / N, n = i % N;
    scalar_t* o = (a && z1) ? z1 + i * D : z + i * D;
    scalar_t p0 = p[r * N + n];
    const scalar_t* e0 = E[r] + n * D;
    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = p0 * e0[d];
    for (int64_t j = 1; j < S; j++) {
      scalar_t pj = p[(j * M + r) * N + n];
      const scalar_t* ej = E[j * M + r] + n * D;
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += pj * ej[d];
    }
    if (a) {
      scalar_t ai = a[i], bi = 1 - a[i];
      const scalar_t* e2 = E2[r] + n * D;
      scalar_t* zo = z + i * D;
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) zo[d] = o[d] * ai + e2[d] * bi;
    }
  }
}
/* Adaptive fusion (kernels/lean.py fuse_forward): z [M][N][D], Wt [M][M*D] (W transposed).    */
void fuse_forward_SUF(int64_t M, int64_t N, int64_t D, const scalar_t* restrict z, const scalar_t* restrict Wt,
                        scalar_t scale, const scalar_t* restrict bias, scalar_t eps, scalar_t* restrict h, scalar_t* restrict H,
                        scalar_t* restrict uW, scalar_t* restrict rs, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t n = 0; n < N; n++) {
    scalar_t sq = 0;
    for (int64_t r = 0; r < M; r++) {
      const scalar_t* zr = z + (r * N + n) * D;
      _Pragma("omp simd reduction(+:sq)") for (int64_t d = 0; d < D; d++) sq += zr[d] * zr[d];
    }
    scalar_t rn = 1 / sqrt(sq / (scalar_t)(M * D) + eps);
    rs[n] = rn;
    scalar_t* Hn = H + n * M;
    for (int64_t m = 0; m < M; m++) {
      scalar_t acc = 0;
      for (int64_t r = 0; r < M; r++) {
        const scalar_t* zr = z + (r * N + n) * D; const scalar_t* wr = Wt + m * M * D + r * D;
        _Pragma("omp simd reduction(+:acc)") for (int64_t d = 0; d < D; d++) acc += zr[d] * wr[d];
      }
      scalar_t u = acc * rn;
      uW[n * M + m] = u;
      Hn[m] = 1 / (1 + exp(-(scale * u + bias[m])));
    }
    scalar_t* o = h + n * D;
    const scalar_t* z0 = z + n * D;
    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = Hn[0] * z0[d];
    for (int64_t r = 1; r < M; r++) {
      const scalar_t* zr = z + (r * N + n) * D; scalar_t hr = Hn[r];
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += hr * zr[d];
    }
  }
}
/* Its backward: dz [M][N][D]; dWt [M][M*D], out3 = (dscale, db[M]) (all overwritten). */
void fuse_backward_SUF(int64_t M, int64_t N, int64_t D, const scalar_t* restrict z, const scalar_t* restrict dh,
                         const scalar_t* restrict H, const scalar_t* restrict uW, const scalar_t* restrict rs,
                         const scalar_t* restrict Wt, scalar_t scale, scalar_t* restrict dz, scalar_t* restrict dWt,
                         scalar_t* restrict out3, int nt) {
  int64_t W = M * M * D + 1 + M;
  scalar_t* part = (scalar_t*)calloc((size_t)nt * W, sizeof(scalar_t));
  _Pragma("omp parallel num_threads(nt)")
  {
    int tid = omp_tid(), nth = omp_nth();
    scalar_t* acc = part + (int64_t)tid * W;
    scalar_t dg[64], t[64];
    int64_t lo = N * tid / nth, hi = N * (tid + 1) / nth;
    for (int64_t n = lo; n < hi; n++) {
      const scalar_t* g = dh + n * D;
      scalar_t c = 0, rn = rs[n];
      for (int64_t m = 0; m < M; m++) {
        const scalar_t* zm = z + (m * N + n) * D;
        scalar_t dH = 0;
        _Pragma("omp simd reduction(+:dH)") for (int64_t d = 0; d < D; d++) dH += g[d] * zm[d];
        scalar_t Hm = H[n * M + m];
        dg[m] = dH * Hm * (1 - Hm);
        c += dg[m] * uW[n * M + m];
        acc[M * M * D + 1 + m] += dg[m];
        t[m] = dg[m] * rn * scale;
      }
      acc[M * M * D] += c;
      scalar_t coef = -rn * rn * c * scale / (scalar_t)(M * D);
      for (int64_t r = 0; r < M; r++) {
        const scalar_t* zr = z + (r * N + n) * D; scalar_t* o = dz + (r * N + n) * D; scalar_t hr = H[n * M + r];
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = g[d] * hr + coef * zr[d];
        for (int64_t m = 0; m < M; m++) {
          const scalar_t* wr = Wt + m * M * D + r * D; scalar_t* aw = acc + m * M * D + r * D;
          scalar_t tm = t[m], gm = dg[m] * rn;
          _Pragma("omp simd") for (int64_t d = 0; d < D; d++) { o[d] += tm * wr[d]; aw[d] += gm * zr[d]; }
        }
      }
    }
  }
  for (int64_t i = 0; i < W; i++) {
    scalar_t v = 0;
    for (int th = 0; th < nt; th++) v += part[(int64_t)th * W + i];
    if (i < M * M * D) dWt[i] = v * scale; else out3[i - M * M * D] = v;
  }
  free(part);
}
/* Sinkhorn of N blocks of n x n (mHC's Hres): y = exp(x - max) normalised iters times by rows, then
   columns. Each normalisation's output (but the last, which is y) goes to sm [2 iters - 1][N][n n] and
   its sums to ss [2 iters][N][n]: what the backward reads. */
void sinkhorn_forward_SUF(int64_t N, int64_t n, int64_t iters, const scalar_t* restrict x, scalar_t* restrict y,
                          scalar_t* restrict sm, scalar_t* restrict ss, int nt) {
  int64_t nn = n * n, last = 2 * iters - 1;
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t t = 0; t < N; t++) {
    const scalar_t* xt = x + t * nn;
    scalar_t* m = y + t * nn;
    scalar_t mx = xt[0];
    for (int64_t i = 1; i < nn; i++) mx = xt[i] > mx ? xt[i] : mx;
    for (int64_t i = 0; i < nn; i++) m[i] = exp(xt[i] - mx);
    for (int64_t step = 0; step <= last; step++) {
      scalar_t* sv = ss + (step * N + t) * n;
      if (step % 2 == 0) {  /* rows */
        for (int64_t i = 0; i < n; i++) {
          scalar_t a = 0;
          for (int64_t j = 0; j < n; j++) a += m[i * n + j];
          sv[i] = a;
          for (int64_t j = 0; j < n; j++) m[i * n + j] /= a;
        }
      } else {  /* columns */
        for (int64_t j = 0; j < n; j++) {
          scalar_t a = 0;
          for (int64_t i = 0; i < n; i++) a += m[i * n + j];
          sv[j] = a;
          for (int64_t i = 0; i < n; i++) m[i * n + j] /= a;
        }
      }
      if (step < last) memcpy(sm + (step * N + t) * nn, m, sizeof(scalar_t) * nn);
    }
  }
}
/* Its backward: each normalisation y = m / sum(m) has dm = (dy - sum(dy * y)) / sum(m); through
   m0 = exp(x - max): dx = dm0 * m0, m0 = y_0 * s_0 (n <= 32). */
void sinkhorn_backward_SUF(int64_t N, int64_t n, int64_t iters, const scalar_t* restrict y, const scalar_t* restrict sm,
                           const scalar_t* restrict ss, const scalar_t* restrict dy, scalar_t* restrict dx, int nt) {
  int64_t nn = n * n, last = 2 * iters - 1;
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t t = 0; t < N; t++) {
    scalar_t g[1024];
    memcpy(g, dy + t * nn, sizeof(scalar_t) * nn);
    for (int64_t step = last; step >= 0; step--) {
      const scalar_t* yv = step == last ? y + t * nn : sm + (step * N + t) * nn;
      const scalar_t* sv = ss + (step * N + t) * n;
      if (step % 2 == 0) {
        for (int64_t i = 0; i < n; i++) {
          scalar_t c = 0;
          for (int64_t j = 0; j < n; j++) c += g[i * n + j] * yv[i * n + j];
          for (int64_t j = 0; j < n; j++) g[i * n + j] = (g[i * n + j] - c) / sv[i];
        }
      } else {
        for (int64_t j = 0; j < n; j++) {
          scalar_t c = 0;
          for (int64_t i = 0; i < n; i++) c += g[i * n + j] * yv[i * n + j];
          for (int64_t i = 0; i < n; i++) g[i * n + j] = (g[i * n + j] - c) / sv[j];
        }
      }
    }
    const scalar_t* y0 = last == 0 ? y + t * nn : sm + t * nn;
    const scalar_t* s0 = ss + t * n;
    for (int64_t i = 0; i < n; i++)
      for (int64_t j = 0; j < n; j++) dx[t * nn + i * n + j] = g[i * n + j] * (y0[i * n + j] * s0[i]);
  }
}
/* mHC's stream mixing per token (x [N][n][D]): premix f_in = sum_i hpre_i x_i; postmix
   out_i = sum_j hres_ij x_j + hpost_i f; their backwards. */
void premix_forward_SUF(int64_t N, int64_t n, int64_t D, const scalar_t* restrict x, const scalar_t* restrict hp,
                        scalar_t* restrict out, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t t = 0; t < N; t++) {
    scalar_t* o = out + t * D;
    const scalar_t* xt = x + t * n * D;
    scalar_t h0 = hp[t * n];
    _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = h0 * xt[d];
    for (int64_t i = 1; i < n; i++) {
      scalar_t hi = hp[t * n + i]; const scalar_t* xi = xt + i * D;
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += hi * xi[d];
    }
  }
}
void premix_backward_SUF(int64_t N, int64_t n, int64_t D, const scalar_t* restrict x, const scalar_t* restrict hp,
                         const scalar_t* restrict g, scalar_t* restrict dx, scalar_t* restrict dhp, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t t = 0; t < N; t++) {
    const scalar_t* gt = g + t * D;
    for (int64_t i = 0; i < n; i++) {
      const scalar_t* xi = x + (t * n + i) * D; scalar_t* di = dx + (t * n + i) * D;
      scalar_t hi = hp[t * n + i], a = 0;
      _Pragma("omp simd reduction(+:a)") for (int64_t d = 0; d < D; d++) { a += gt[d] * xi[d]; di[d] = hi * gt[d]; }
      dhp[t * n + i] = a;
    }
  }
}
void postmix_forward_SUF(int64_t N, int64_t n, int64_t D, const scalar_t* restrict x, const scalar_t* restrict hr,
                         const scalar_t* restrict hq, const scalar_t* restrict f, scalar_t* restrict out, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t t = 0; t < N; t++) {
    const scalar_t* xt = x + t * n * D; const scalar_t* ft = f + t * D;
    for (int64_t i = 0; i < n; i++) {
      scalar_t* o = out + (t * n + i) * D;
      scalar_t q = hq[t * n + i];
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = q * ft[d];
      for (int64_t j = 0; j < n; j++) {
        scalar_t h = hr[(t * n + i) * n + j]; const scalar_t* xj = xt + j * D;
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += h * xj[d];
      }
    }
  }
}
void postmix_backward_SUF(int64_t N, int64_t n, int64_t D, const scalar_t* restrict x, const scalar_t* restrict hr,
                          const scalar_t* restrict hq, const scalar_t* restrict f, const scalar_t* restrict g,
                          scalar_t* restrict dx, scalar_t* restrict dhr, scalar_t* restrict dhq, scalar_t* restrict df,
                          int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t t = 0; t < N; t++) {
    const scalar_t* xt = x + t * n * D; const scalar_t* ft = f + t * D; const scalar_t* gt = g + t * n * D;
    scalar_t* dft = df + t * D;
    for (int64_t i = 0; i < n; i++) {  /* dhq_i = <g_i, f>, df = sum_i hq_i g_i, dhr_ij = <g_i, x_j> */
      const scalar_t* gi = gt + i * D;
      scalar_t q = hq[t * n + i], a = 0;
      if (i == 0) {
        _Pragma("omp simd reduction(+:a)") for (int64_t d = 0; d < D; d++) { a += gi[d] * ft[d]; dft[d] = q * gi[d]; }
      } else {
        _Pragma("omp simd reduction(+:a)") for (int64_t d = 0; d < D; d++) { a += gi[d] * ft[d]; dft[d] += q * gi[d]; }
      }
      dhq[t * n + i] = a;
      for (int64_t j = 0; j < n; j++) {
        const scalar_t* xj = xt + j * D; scalar_t b = 0;
        _Pragma("omp simd reduction(+:b)") for (int64_t d = 0; d < D; d++) b += gi[d] * xj[d];
        dhr[(t * n + i) * n + j] = b;
      }
    }
    for (int64_t j = 0; j < n; j++) {  /* dx_j = sum_i hr_ij g_i */
      scalar_t* dj = dx + (t * n + j) * D;
      scalar_t h0 = hr[(t * n) * n + j];
      _Pragma("omp simd") for (int64_t d = 0; d < D; d++) dj[d] = h0 * gt[d];
      for (int64_t i = 1; i < n; i++) {
        scalar_t h = hr[(t * n + i) * n + j]; const scalar_t* gi = gt + i * D;
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) dj[d] += h * gi[d];
      }
    }
  }
}
/* dots[q][n] = <g_q[n], E[n]> */
void phase1_dots_SUF(int64_t Q, int64_t N, int64_t D, const scalar_t* restrict E, const scalar_t* const* g,
                       scalar_t* restrict dots, int nt) {
  _Pragma("omp parallel for num_threads(nt) schedule(static)")
  for (int64_t n = 0; n < N; n++) {
    const scalar_t* e = E + n * D;
    for (int64_t q = 0; q < Q; q++) {
      const scalar_t* gq = g[q] + n * D;
      scalar_t acc = 0;
      _Pragma("omp simd reduction(+:acc)") for (int64_t d = 0; d < D; d++) acc += gq[d] * e[d];
      dots[q * N + n] = acc;
    }
  }
}
/* dE[n] (= or +=, accumulate) sum_q a1[q][n] qg[q] + a2[n] E[n] + sum_q P[q][n] g_q[n];  dqg[q] += sum_n a1[q][n] E[n] */
void phase1_grad_SUF(int64_t Q, int64_t N, int64_t D, const scalar_t* restrict E, const scalar_t* const* g,
                       const scalar_t* restrict P, const scalar_t* restrict a1, const scalar_t* restrict a2,
                       const scalar_t* const* qg, scalar_t* restrict dE, scalar_t* restrict dqg, int accumulate, int nt) {
  scalar_t* part = (scalar_t*)calloc((size_t)nt * Q * D, sizeof(scalar_t));
  _Pragma("omp parallel num_threads(nt)")
  {
    int tid = omp_tid(), nth = omp_nth();
    scalar_t* acc = part + (int64_t)tid * Q * D;
    int64_t lo = N * tid / nth, hi = N * (tid + 1) / nth;
    for (int64_t n = lo; n < hi; n++) {
      const scalar_t* e = E + n * D;
      scalar_t* o = dE + n * D;
      scalar_t c2 = a2[n];
      if (accumulate) {
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] += c2 * e[d];
      } else {
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) o[d] = c2 * e[d];
      }
      for (int64_t q = 0; q < Q; q++) {
        scalar_t c1 = a1[q * N + n], pq = P[q * N + n];
        const scalar_t* gq = g[q] + n * D; const scalar_t* qq = qg[q]; scalar_t* aq = acc + q * D;
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) { o[d] += c1 * qq[d] + pq * gq[d]; aq[d] += c1 * e[d]; }
      }
    }
  }
  for (int64_t i = 0; i < Q * D; i++) {
    scalar_t v = 0;
    for (int th = 0; th < nt; th++) v += part[(int64_t)th * Q * D + i];
    dqg[i] += v;
  }
  free(part);
}

"""

_SRC = _HEADER + "".join(_TEMPLATE.replace("scalar_t", ct).replace("_SUF", "_" + suf) for ct, suf in (("float", "f32"), ("double", "f64")))

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_CTYPE = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}
_lib = None
_tried = False


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC", "cc")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm"]
    tag = hashlib.sha256((_SRC + cc + " ".join(flags)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MSAR_NATIVE_CACHE", Path.home() / ".cache" / "msar_train"))
    so = cache / f"msar_native_{tag}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_file, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
            c_file.write_text(_SRC)
            res = subprocess.run([cc, *flags, str(c_file), "-o", str(out)], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed:\n{res.stderr[-2000:]}")
            os.replace(out, so)  # atomic: concurrent ranks building at once each land a whole file
    return ctypes.CDLL(str(so))


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (``MSAR_NATIVE=0``, or no working compiler: warned once)."""
    global _lib, _tried
    if os.environ.get("MSAR_NATIVE", "1") == "0":
        return None
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except (OSError, RuntimeError) as exc:
            warnings.warn(f"msar_train native CPU kernels unavailable, using the torch ops: {exc}", stacklevel=2)
            _lib = None
    return _lib


def usable(*tensors: torch.Tensor) -> bool:
    """True when the native loops apply to these tensors (CPU, fp32/fp64 of one dtype, library built)."""
    t0 = tensors[0]
    if t0.device.type != "cpu" or t0.dtype not in _SUFFIX:
        return False
    if any(t.device.type != "cpu" or t.dtype != t0.dtype for t in tensors):
        return False
    return library() is not None


def conv_usable(s_BTD: torch.Tensor, weights: list[torch.Tensor], *more: torch.Tensor) -> bool:
    """:func:`usable` for a conv expansion (at least one conv stream)."""
    return bool(weights) and usable(s_BTD, *weights, *more)


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def _ptrs(ts: list[torch.Tensor]):
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def _fn(name: str, dtype: torch.dtype):
    f = getattr(library(), f"{name}_{_SUFFIX[dtype]}")
    f.restype = None
    return f


def _nt() -> int:
    return ctypes.c_int(torch.get_num_threads())


def _doc(doc_ids_BT: torch.Tensor | None):
    if doc_ids_BT is None:
        return None, ctypes.c_void_p(None)
    d = doc_ids_BT.to(torch.int64).contiguous()
    return d, _ptr(d)


def conv_forward(s_BTD: torch.Tensor, weights: list[torch.Tensor], doc_ids_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ec_CBTD, sq_MBT): the C conv streams of ``s_BTD`` and the per-token sums of squares of all
    M = C + 1 streams (stream 0 the source itself)."""
    s = s_BTD.contiguous()
    B, T, D = s.shape
    C = len(weights)
    ws = [w.to(s.dtype).contiguous() for w in weights]
    Ks = (ctypes.c_int64 * C)(*[w.shape[0] for w in ws])
    out = torch.empty(C, B, T, D, dtype=s.dtype)
    sq = torch.empty(C + 1, B, T, dtype=s.dtype)
    keep, doc = _doc(doc_ids_BT)
    _fn("conv_forward", s.dtype)(_ptr(s), B, T, D, C, _ptrs(ws), Ks, doc, _ptr(out), _ptr(sq), _nt())
    return out, sq


def conv_backward(
    s_BTD: torch.Tensor, weights: list[torch.Tensor], doc_ids_BT: torch.Tensor | None, dEc_CBTD: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(ds_BTD, [dw_KD per conv stream]) of :func:`conv_forward`'s streams given their gradient."""
    s = s_BTD.contiguous()
    dE = dEc_CBTD.to(s.dtype).contiguous()
    B, T, D = s.shape
    C = len(weights)
    ws = [w.to(s.dtype).contiguous() for w in weights]
    Ks = (ctypes.c_int64 * C)(*[w.shape[0] for w in ws])
    ds = torch.empty_like(s)
    dws = [torch.empty_like(w) for w in ws]
    keep, doc = _doc(doc_ids_BT)
    _fn("conv_backward", s.dtype)(_ptr(s), B, T, D, C, _ptrs(ws), Ks, doc, _ptr(dE), _ptr(ds), _ptrs(dws), _nt())
    return ds, [dw.to(w.dtype) for dw, w in zip(dws, weights)]


def weighted_sum(
    p_SMN: torch.Tensor,
    streams_S: list[list[torch.Tensor]],
    a_MN: torch.Tensor | None = None,
    E2: list[torch.Tensor] | None = None,
    want_z1: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(z_MBTD, z1_MBTD or None): ``z1_r = sum_j p[j, r] streams_S[j][r]``; with ``a_MN`` and the
    partial's streams ``E2``, ``z = a z1 + (1 - a) E2`` (else z is z1). Streams: contiguous [B,T,D]."""
    first = streams_S[0][0]
    B, T, D = first.shape
    S, M, N = p_SMN.shape
    dt = first.dtype
    flat = [e for st in streams_S for e in st]
    p = p_SMN.to(dt).contiguous()
    z = torch.empty(M, B, T, D, dtype=dt)
    z1 = torch.empty(M, B, T, D, dtype=dt) if (a_MN is not None and want_z1) else None
    null = ctypes.c_void_p(None)
    if a_MN is None:
        args = (null, null, _ptr(z), null)
    else:  # without a z1 buffer the kernel accumulates z1 in z's row, then merges in place
        a = a_MN.to(dt).contiguous()
        args = (_ptr(a), _ptrs(E2), _ptr(z), null if z1 is None else _ptr(z1))
    _fn("weighted_sum", dt)(S, M, N, D, _ptrs(flat), _ptr(p), *args, _nt())
    return z, z1


def phase1_dots(E_ND: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """``dots [Q, N]``: ``<grads[q][n], E[n]>`` (all contiguous [N, D] of one dtype)."""
    N, D = E_ND.shape
    dots = torch.empty(len(grads), N, dtype=E_ND.dtype)
    _fn("phase1_dots", E_ND.dtype)(len(grads), N, D, _ptr(E_ND), _ptrs(grads), _ptr(dots), _nt())
    return dots


def phase1_grad(
    E_ND: torch.Tensor,
    grads: list[torch.Tensor],
    P_QN: torch.Tensor,
    a1_QN: torch.Tensor,
    a2_N: torch.Tensor,
    qg: list[torch.Tensor],
    out_ND: torch.Tensor,
    dqg_QD: torch.Tensor,
    accumulate: bool = False,
) -> None:
    """``out = sum_q a1_q qg_q + a2 E + sum_q P_q grads_q`` (written; added to ``out`` with
    ``accumulate``), ``dqg_QD[q] += sum_n a1_q E``."""
    N, D = E_ND.shape
    dt = E_ND.dtype
    P, a1, a2 = P_QN.to(dt).contiguous(), a1_QN.to(dt).contiguous(), a2_N.to(dt).contiguous()
    qgs = [q.to(dt).contiguous() for q in qg]
    _fn("phase1_grad", dt)(
        len(grads),
        N,
        D,
        _ptr(E_ND),
        _ptrs(grads),
        _ptr(P),
        _ptr(a1),
        _ptr(a2),
        _ptrs(qgs),
        _ptr(out_ND),
        _ptr(dqg_QD),
        int(accumulate),
        _nt(),
    )


def fuse_forward(z_MND: torch.Tensor, weight: torch.Tensor, scale: float, bias: torch.Tensor, eps: float):
    """(h_ND, H_NM, uW_NM, rs_N) of the adaptive fusion (``lean.fuse_forward``'s math) in one pass."""
    M, N, D = z_MND.shape
    dt = z_MND.dtype
    Wt = weight.to(dt).t().contiguous()
    b = bias.to(dt).contiguous()
    h = torch.empty(N, D, dtype=dt)
    H, uW, rs = torch.empty(N, M, dtype=dt), torch.empty(N, M, dtype=dt), torch.empty(N, dtype=dt)
    c = _CTYPE[dt]
    _fn("fuse_forward", dt)(M, N, D, _ptr(z_MND), _ptr(Wt), c(scale), _ptr(b), c(eps), _ptr(h), _ptr(H), _ptr(uW), _ptr(rs), _nt())
    return h, H, uW, rs


def fuse_backward(z_MND, dh_ND, H, uW, rs, weight: torch.Tensor, scale: float):
    """(dz_MND, dscale [1], dW [M*D, M], db [M]) of :func:`fuse_forward` given ``dh``."""
    M, N, D = z_MND.shape
    dt = z_MND.dtype
    Wt = weight.to(dt).t().contiguous()
    dz = torch.empty(M, N, D, dtype=dt)
    dWt = torch.empty(M, M * D, dtype=dt)
    out3 = torch.empty(1 + M, dtype=dt)
    _fn("fuse_backward", dt)(
        M, N, D, _ptr(z_MND), _ptr(dh_ND), _ptr(H), _ptr(uW), _ptr(rs), _ptr(Wt), _CTYPE[dt](scale), _ptr(dz), _ptr(dWt), _ptr(out3), _nt()
    )
    return dz, out3[:1], dWt.t(), out3[1:]


def row_dots(E_ND: torch.Tensor, V_QD: torch.Tensor) -> torch.Tensor:
    """``[Q, N]``: ``<E[n], V[q]>`` (the logits of Q pseudo-queries against one stream), one read of E."""
    N, D = E_ND.shape
    V = V_QD.to(E_ND.dtype).contiguous()
    out = torch.empty(V.shape[0], N, dtype=E_ND.dtype)
    _fn("row_dots", E_ND.dtype)(V.shape[0], N, D, _ptr(E_ND), _ptr(V), _ptr(out), _nt())
    return out


def sinkhorn_forward(x_BTNN: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, sm, ss): mHC's Sinkhorn (``residual/mhc.py``) of contiguous ``[..., n, n]`` blocks, n <= 32,
    iters >= 1; ``sm`` / ``ss`` hold each normalisation's output (but the last: y) and sums."""
    n = x_BTNN.shape[-1]
    N = x_BTNN.numel() // (n * n)
    dt = x_BTNN.dtype
    y = torch.empty_like(x_BTNN)
    sm = torch.empty(2 * iters - 1, N, n * n, dtype=dt)
    ss = torch.empty(2 * iters, N, n, dtype=dt)
    _fn("sinkhorn_forward", dt)(N, n, iters, _ptr(x_BTNN), _ptr(y), _ptr(sm), _ptr(ss), _nt())
    return y, sm, ss


def sinkhorn_backward(y: torch.Tensor, sm: torch.Tensor, ss: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The logits' gradient of :func:`sinkhorn_forward` given ``dy`` (same shape as y)."""
    n = y.shape[-1]
    N = y.numel() // (n * n)
    iters = ss.shape[0] // 2
    dy = dy.to(y.dtype).contiguous()
    dx = torch.empty_like(y)
    _fn("sinkhorn_backward", y.dtype)(N, n, iters, _ptr(y), _ptr(sm), _ptr(ss), _ptr(dy), _ptr(dx), _nt())
    return dx


def premix(x_BTND: torch.Tensor, h_BTN: torch.Tensor) -> torch.Tensor:
    """``sum_i h[..., i] x[..., i, :]`` per token (mHC's branch input)."""
    B, T, n, D = x_BTND.shape
    out = torch.empty(B, T, D, dtype=x_BTND.dtype)
    _fn("premix_forward", x_BTND.dtype)(B * T, n, D, _ptr(x_BTND), _ptr(h_BTN), _ptr(out), _nt())
    return out


def premix_backward(x_BTND, h_BTN, g_BTD) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, n, D = x_BTND.shape
    dx, dh = torch.empty_like(x_BTND), torch.empty_like(h_BTN)
    _fn("premix_backward", x_BTND.dtype)(B * T, n, D, _ptr(x_BTND), _ptr(h_BTN), _ptr(g_BTD), _ptr(dx), _ptr(dh), _nt())
    return dx, dh


def postmix(x_BTND, hres_BTNN, hpost_BTN, f_BTD) -> torch.Tensor:
    """``hres @ x + hpost f`` per token (mHC's new streams)."""
    B, T, n, D = x_BTND.shape
    out = torch.empty_like(x_BTND)
    _fn("postmix_forward", x_BTND.dtype)(B * T, n, D, _ptr(x_BTND), _ptr(hres_BTNN), _ptr(hpost_BTN), _ptr(f_BTD), _ptr(out), _nt())
    return out


def postmix_backward(x_BTND, hres_BTNN, hpost_BTN, f_BTD, g_BTND):
    """(dx, dhres, dhpost, df) of :func:`postmix`."""
    B, T, n, D = x_BTND.shape
    dx, dhr, dhq, df = torch.empty_like(x_BTND), torch.empty_like(hres_BTNN), torch.empty_like(hpost_BTN), torch.empty_like(f_BTD)
    _fn("postmix_backward", x_BTND.dtype)(
        B * T,
        n,
        D,
        _ptr(x_BTND),
        _ptr(hres_BTNN),
        _ptr(hpost_BTN),
        _ptr(f_BTD),
        _ptr(g_BTND),
        _ptr(dx),
        _ptr(dhr),
        _ptr(dhq),
        _ptr(df),
        _nt(),
    )
    return dx, dhr, dhq, df
