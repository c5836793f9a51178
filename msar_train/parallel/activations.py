"""What each layer of ``Transformer.layers()`` keeps for backward, per micro-batch, counted from its code.

Counted tensor by tensor from ``model/attention.py``, ``ffn.py``, ``moe.py``, ``norm.py``, ``layers.py``
(the tensors autograd saves, or that stay referenced until backward), plus the residual site's own
tensors from ``ResidualBackend.site_activation_bytes``. ``e`` = bytes per activation element; tensors
the code computes in fp32 whatever the dtype (RoPE angles, router scores, bf16 norm internals, the
loss's log-softmax) count 4 bytes.

Legend: N = B*T tokens, D d_model, H query heads, G kv heads, E head dim, F dense FFN width,
X routed experts, K top_k, He expert width, Hs shared width (n_shared * He), Vo vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msar_train.parallel.comm import carry_specs


@dataclass(frozen=True)
class LayerActivations:
    input_bytes: int  # the carry entering the layer
    output_bytes: int  # the carry leaving it (what a checkpoint of the next layer keeps)
    retained: int  # kept for backward by the layer itself (its output state included), no checkpointing
    transient: int  # the extra peak while the layer runs backward (and, at the head, the loss)
    loss_kept: int = 0  # kept by the loss outside the layer (a checkpoint of the layer keeps it too)
    transient_ckpt: int | None = None  # the transient when the layer is checkpointed (None: the same)


def _carry_bytes(backend, after_layer: int, B: int, T: int, dtype: torch.dtype, document_mask: bool) -> int:
    return sum(s.nbytes for s in carry_specs(backend, after_layer, B, T, dtype, document_mask))


def rmsnorm_bytes(N: int, D: int, e: int) -> int:
    """RMSNorm: the normalised ``y`` and the weighted output; in bf16 also the fp32 input copy, and
    ``y`` is fp32."""
    return 2 * e * N * D if e == 4 else (4 + 4 + e) * N * D


def attention_bytes(N: int, mc, e: int) -> int:
    """Norm, v, RoPE'd q and k (+ their fp32 cos/sin), the SDPA output and logsumexp, the head merge."""
    H, G = mc.n_heads, mc.n_kv_heads
    E = mc.head_dim or mc.d_model // H
    return rmsnorm_bytes(N, mc.d_model, e) + e * N * E * (3 * H + 2 * G) + 8 * N * E + 4 * N * H


def swiglu_bytes(N: int, hidden: int, e: int) -> int:
    """gate output, its silu, up output, their product (each [N, hidden])."""
    return 4 * e * N * hidden


def moe_bytes(N: int, mc, e: int) -> int:
    """Norm, router (fp32 scores and the top-k bookkeeping), dropless dispatch buffers (the gathered
    [N K, D] inputs, the concatenated expert outputs and their weighted copy), the routed experts'
    SwiGLU on N K rows and the shared experts on N rows."""
    D, mo = mc.d_model, mc.moe
    X, K = mo.n_routed, mo.top_k
    router = 4 * N * X + 4 * N * D * (e != 4) + 8 * 3 * N * K + 4 * 3 * N * K
    dispatch = e * N * K * D * 3 + 4 * N * K * D * (e != 4)
    shared = swiglu_bytes(N, mo.expert_hidden * mo.n_shared, e) if mo.n_shared else 0
    return rmsnorm_bytes(N, D, e) + router + dispatch + swiglu_bytes(N * K, mo.expert_hidden, e) + shared


def block_bytes(i: int, N: int, mc, e: int) -> tuple[int, int]:
    """(retained, largest single tensor) of block i without its residual sites."""
    attn = attention_bytes(N, mc, e)
    if i < mc.first_k_dense:
        ffn = rmsnorm_bytes(N, mc.d_model, e) + swiglu_bytes(N, mc.dense_hidden, e)
        largest = e * N * mc.dense_hidden
    else:
        ffn = moe_bytes(N, mc, e)
        largest = e * N * max(mc.moe.top_k * max(mc.d_model, mc.moe.expert_hidden), mc.moe.expert_hidden * mc.moe.n_shared)
    return attn + ffn, largest


def layer_activations(cfg, backend, B: int, T: int, dtype: torch.dtype, pipelined: bool) -> list[LayerActivations]:
    """One entry per layer of ``Transformer.layers()``. ``pipelined``: the pipeline engine keeps the
    head's logits in its output buffer until backward (the single-process step drops them after the loss)."""
    mc, dm = cfg.model, cfg.data.document_mask
    e = torch.empty((), dtype=dtype).element_size()
    N, D = B * T, mc.d_model
    out = []
    ids = 8 * N * (3 if dm else 1)
    emb_out = _carry_bytes(backend, 0, B, T, dtype, dm)
    out.append(LayerActivations(ids, emb_out, emb_out, 0))  # the entry state is all it keeps
    for i in range(mc.n_layers):
        inp = _carry_bytes(backend, i, B, T, dtype, dm)
        outp = _carry_bytes(backend, i + 1, B, T, dtype, dm)
        own, largest = block_bytes(i, N, mc, e)
        sites = sum(backend.site_activation_bytes(i, sub, B, T, e) for sub in (0, 1))
        # backward: the gradient of the carry in and out, and of the largest intermediate, twice,
        # plus what the residual sites' own backward holds
        transient = inp + outp + 2 * largest
        site_bw = [max(backend.site_backward_bytes(i, sub, B, T, e, ck) for sub in (0, 1)) for ck in (False, True)]
        out.append(LayerActivations(inp, outp, own + sites, transient + site_bw[0], transient_ckpt=transient + site_bw[1]))
    inp = _carry_bytes(backend, mc.n_layers, B, T, dtype, dm)
    V = mc.vocab_size
    head = rmsnorm_bytes(N, D, e) + backend.exit_activation_bytes(B, T, e)
    logits = e * N * V
    # loss: fp32 log-softmax kept for backward (and the fp32 copy of bf16 logits while it is made);
    # backward: the log-softmax gradient and the logits' gradient, both fp32, at once
    kept = logits if pipelined else 0
    transient = max(logits + 4 * N * V * (e != 4), 2 * 4 * N * V) + (0 if pipelined else logits)
    # the exit's backward runs after the logits' gradient is gone
    exit_bw = [inp + backend.site_backward_bytes(mc.n_layers, 0, B, T, e, ck) for ck in (False, True)]
    out.append(
        LayerActivations(
            inp,
            logits if pipelined else 0,
            head + kept,
            max(transient, exit_bw[0]),
            loss_kept=4 * N * V,
            transient_ckpt=max(transient, exit_bw[1]),
        )
    )
    return out
