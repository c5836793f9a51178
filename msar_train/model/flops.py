"""Analytic training FLOPs per token: the model's matmuls and attention plus the residual backend's math.

Counted, not measured: one multiply-add = 2 FLOPs, training = forward + backward = 3x forward. Matmuls
count the *active* parameters a token passes through (dense FFN in the first ``first_k_dense`` layers;
router, shared and ``top_k`` routed experts in MoE layers), attention counts ``QK^T`` and ``AV`` over the
causal half of a ``seq``-long window. The residual backend counts its own math
(``ResidualBackend.forward_flops_per_token``): 1 add per branch for vanilla, the depth attention and
expansions for attnres / msar, the stream maps and Sinkhorn for mHC. Used by the study records
(``train/records.py``) and ``scripts/bench_residuals.py``.
"""

from __future__ import annotations

from msar_train.residual import build_backend


def matmul_params_per_token(mc) -> int:
    """Weights a token multiplies with in one forward (embedding lookup excluded, LM head included)."""
    d = mc.d_model
    hd = mc.head_dim or d // mc.n_heads
    attn = d * hd * (2 * mc.n_heads + 2 * mc.n_kv_heads)
    dense = 3 * d * mc.dense_hidden
    moe = mc.moe
    sparse = 3 * d * moe.expert_hidden * (moe.top_k + moe.n_shared) + d * moe.n_routed
    layers = sum(attn + (dense if i < mc.first_k_dense else sparse) for i in range(mc.n_layers))
    return layers + d * mc.vocab_size


def model_flops_per_token(mc, seq: int) -> float:
    """Training FLOPs per token of the model without its residual math (what vanilla adds is ~0)."""
    hd = mc.head_dim or mc.d_model // mc.n_heads
    matmul = 6 * matmul_params_per_token(mc)
    attention = 6 * mc.n_layers * mc.n_heads * hd * seq  # 2 matmuls x 2 FLOPs x causal half of seq, x3
    return float(matmul + attention)


def non_embedding_flops_per_token(mc, seq: int) -> float:
    """``model_flops_per_token`` without the LM head: the x-axis of scaling studies (Kaplan et al.)."""
    return model_flops_per_token(mc, seq) - 6.0 * mc.d_model * mc.vocab_size


def residual_flops_per_token(mc, residual_cfg) -> float:
    """Training FLOPs per token of the residual backend's own math."""
    backend = build_backend(residual_cfg, mc.n_layers, mc.d_model, mc.norm_eps, mc.init_std)
    return 3.0 * backend.forward_flops_per_token()


def training_flops_per_token(mc, residual_cfg, seq: int) -> float:
    return model_flops_per_token(mc, seq) + residual_flops_per_token(mc, residual_cfg)
