"""Activation checkpointing of the single-process Transformer (``parallel.activation_checkpointing`` with
``pp_stages=1``): same loss and gradients as without, blocks really recomputed, MoE load counted once."""

from __future__ import annotations

import pytest
import torch

from msar_train.model.transformer import lm_loss
from tests.unit.helpers import build, ids, perturb_residual, preset


def _run(name: str, checkpointing: bool):
    model = build(preset(name), n_layers=4)
    perturb_residual(model)
    model.activation_checkpointing = checkpointing
    calls = [0]
    for b in model.blocks:
        b.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    x_BT = ids(batch=2, seq=12, seed=3)
    total, ce = lm_loss(model(x_BT), torch.roll(x_BT, -1, dims=1))
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.load_counts.clone() for m in model.moe_layers()]
    return total.item(), ce.item(), grads, loads, calls[0]


@pytest.mark.parametrize("name", ["msar", "mhc"])
def test_checkpointed_blocks_give_the_same_loss_and_grads(name):
    loss0, ce0, g0, load0, calls0 = _run(name, False)
    loss1, ce1, g1, load1, calls1 = _run(name, True)
    assert calls0 == 4 and calls1 == 8  # every block ran again in backward
    assert loss1 == pytest.approx(loss0, rel=1e-12) and ce1 == pytest.approx(ce0, rel=1e-12)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-12, msg=n)
    # The recompute is not a new forward: the MoE load counters (router bias updates) see it once.
    for a, b in zip(load0, load1):
        assert torch.equal(a, b) and a.sum() > 0


def test_no_recompute_without_grad():
    model = build(preset("msar", n_blocks=2), n_layers=2)
    model.activation_checkpointing = True
    calls = [0]
    for b in model.blocks:
        b.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with torch.no_grad():
        model(ids())
    assert calls[0] == 2
