"""The analytic FLOPs count (model/flops.py) against torch's own FLOP counter on a real forward."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from msar_train.config import compose_config
from msar_train.model.flops import matmul_params_per_token, model_flops_per_token, non_embedding_flops_per_token, training_flops_per_token
from msar_train.model.transformer import Transformer


def _counted_forward(cfg, B: int, T: int) -> int:
    model = Transformer(cfg.model, cfg.residual, seed=0)
    ids = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    # The math SDPA backend is plain bmm (counted); the fused CPU kernel is not in torch's counter.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(ids)
    return fc.get_total_flops()


def test_matmul_count_matches_torch_flop_counter():
    """Vanilla: every matmul of a forward is a weight matmul (2 FLOPs per weight per token, top_k routed
    experts, shared experts and router included) or SDPA, which torch counts over the full T x T."""
    cfg = compose_config(["residual=vanilla", "model.moe.n_routed=4", "model.moe.top_k=2"])
    mc, B, T = cfg.model, 2, 32
    hd = mc.head_dim or mc.d_model // mc.n_heads
    sdpa_full = 4 * B * mc.n_layers * mc.n_heads * T * T * hd
    assert _counted_forward(cfg, B, T) == 2 * B * T * matmul_params_per_token(mc) + sdpa_full
    # Training count: 3x forward, attention over the causal half of the window.
    assert model_flops_per_token(mc, T) == 3 * (2 * matmul_params_per_token(mc) + sdpa_full / (2 * B * T))
    assert non_embedding_flops_per_token(mc, T) == model_flops_per_token(mc, T) - 6 * mc.d_model * mc.vocab_size


@pytest.mark.parametrize("residual", ["mhc", "attnres", "msar", "msar_full", "msar_no_conv"])
def test_residual_math_is_counted(residual):
    """Every backend adds its own math: more than vanilla's adds, and more with more streams or blocks."""
    base = compose_config(["residual=vanilla"])
    cfg = compose_config([f"residual={residual}"])
    extra = training_flops_per_token(cfg.model, cfg.residual, 128) - training_flops_per_token(base.model, base.residual, 128)
    assert extra > 0
    more = compose_config([f"residual={residual}", "model.n_layers=12"])
    assert training_flops_per_token(more.model, more.residual, 128) > training_flops_per_token(cfg.model, cfg.residual, 128)


def test_msar_streams_and_convs_cost_more_than_attnres():
    def res_flops(name: str, *extra: str) -> float:
        c, v = compose_config([f"residual={name}", *extra]), compose_config(["residual=vanilla"])
        return training_flops_per_token(c.model, c.residual, 128) - training_flops_per_token(v.model, v.residual, 128)

    assert res_flops("msar") > res_flops("msar_no_conv") > res_flops("attnres")
    assert res_flops("msar_m8") > res_flops("msar") > res_flops("msar_m2")
