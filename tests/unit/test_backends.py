"""Backend properties the issue lists: shapes, causality, gradients, determinism, equivalences, cuts."""

import pytest
import torch

from msar_train.kernels import depth_attention as da
from msar_train.model.transformer import lm_loss
from msar_train.residual.depth import SourceExpansion
from msar_train.residual.mhc import MHCSite
from tests.unit.helpers import RESIDUAL_PRESETS, build, ids, perturb_residual, preset


@pytest.mark.parametrize("name", RESIDUAL_PRESETS)
def test_shapes_and_state_shapes(name):
    m = build(preset(name), n_layers=4, dtype=torch.float32)
    x = ids(batch=2, seq=10)
    logits, aux = m(x)
    assert logits.shape == (2, 10, 64) and aux.dim() == 0
    carry = m.embed(x)
    for k, blk in enumerate(m.blocks):
        state = carry[1:]
        assert [tuple(t.shape) for t in state] == m.backend.state_shapes(k, 2, 10)
        carry = blk(carry)
    assert [tuple(t.shape) for t in carry[1:]] == m.backend.state_shapes(4, 2, 10)


@pytest.mark.parametrize("name", RESIDUAL_PRESETS)
def test_causality(name):
    m = build(preset(name), n_layers=4)
    perturb_residual(m)
    a = ids(batch=2, seq=16, seed=1)
    b = a.clone()
    t = 6
    b[:, t + 1 :] = (b[:, t + 1 :] + 7) % 64
    la, lb = m(a)[0], m(b)[0]
    torch.testing.assert_close(la[:, : t + 1], lb[:, : t + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(la[:, t + 1 :], lb[:, t + 1 :])


@pytest.mark.parametrize("name", RESIDUAL_PRESETS)
def test_document_mask_isolates_documents(name):
    """Perturbing document A changes no logit of document B packed after it (attention, MSAR's convs,
    every backend's mixing), while without the mask the same edit leaks into B."""
    m = build(preset(name), n_layers=4, document_mask=True)
    perturb_residual(m)
    a = ids(batch=1, seq=12, seed=2)
    doc = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.tensor([list(range(5)) + list(range(7))])
    b = a.clone()
    b[:, :5] = (b[:, :5] + 3) % 64  # change only document 0
    la, lb = m(a, doc, pos)[0], m(b, doc, pos)[0]
    torch.testing.assert_close(la[:, 5:], lb[:, 5:], rtol=0, atol=1e-12)
    m2 = build(preset(name), n_layers=4)
    perturb_residual(m2)
    assert not torch.allclose(m2(a)[0][:, 5:], m2(b)[0][:, 5:])


@pytest.mark.parametrize("name", RESIDUAL_PRESETS)
def test_every_parameter_gets_a_gradient(name):
    m = build(preset(name), n_layers=4, dtype=torch.float32)
    perturb_residual(m, scale=0.1)
    x = ids(batch=4, seq=32)
    loss, _ = lm_loss(m(x), x)
    loss.backward()
    idle = {f"blocks.{b.layer_idx}.ffn.experts.{e}." for b in m.blocks if b.is_moe for e in range(4) if b.ffn.last_load[e] == 0}
    missing = [
        n for n, p in m.named_parameters() if (p.grad is None or not p.grad.abs().sum() > 0) and not any(n.startswith(i) for i in idle)
    ]
    assert missing == []


@pytest.mark.parametrize("name", ["vanilla", "mhc", "attnres", "msar"])
def test_seeded_runs_are_bitwise_equal(name):
    def run():
        m = build(preset(name), n_layers=4, dtype=torch.float32, seed=7)
        loss, _ = lm_loss(m(ids(seq=16)), ids(seq=16))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    (l1, g1), (l2, g2) = run(), run()
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def _identity_convs(m):
    for bank in m.backend._banks.values():
        for w in bank.weights:
            with torch.no_grad():
                w.zero_()
                w[0] = 1.0


@pytest.mark.parametrize("name", ["attnres", "attnres_full", "msar", "msar_full", "msar_m2", "msar_no_conv", "msar_mean_fusion"])
def test_zero_queries_reduce_to_vanilla(name):
    # Uniform depth weights give vanilla's hidden state divided by the number of sources; every
    # consumer is an RMSNorm, which removes that scale up to its eps (made negligible here).
    van = build(preset("vanilla"), n_layers=4, seed=3, norm_eps=1e-12)
    m = build(preset(name), n_layers=4, seed=3, norm_eps=1e-12)
    _identity_convs(m)
    for mod in m.modules():
        if hasattr(mod, "fusion_weight"):
            with torch.no_grad():
                mod.fusion_weight.zero_()  # equal fusion weights
    x = ids(seq=12)
    lv, lm = van(x)[0], m(x)[0]
    assert ((lv - lm).norm() / lv.norm()).item() < 1e-5


def test_msar_m1_mean_equals_block_attnres_exactly():
    a = build(preset("attnres", n_blocks=3), n_layers=3, seed=5)
    b = build(preset("msar", n_blocks=3, num_streams=1, kernel_sizes=[], fusion="mean"), n_layers=3, seed=5)
    for m in (a, b):
        perturb_residual(m, seed=9)
    x = ids(seq=11)
    assert torch.equal(a(x)[0], b(x)[0])


@pytest.mark.parametrize("name", ["attnres", "msar"])
def test_one_branch_per_block_equals_full(name):
    blk = build(preset(name, n_blocks=8), n_layers=4, seed=2)
    full = build(preset(name, n_blocks=None), n_layers=4, seed=2)
    for m in (blk, full):
        perturb_residual(m, seed=4)
    x = ids(seq=9)
    assert torch.equal(blk(x)[0], full(x)[0])


@pytest.mark.parametrize("m_streams,conv", [(1, False), (4, True), (3, False)])
def test_two_phase_equals_direct_softmax(m_streams, conv):
    g = torch.Generator().manual_seed(0)
    B, T, D = 2, 9, 8
    ks = [2, 5, 3][: m_streams - 1]
    banks = [SourceExpansion(D, m_streams, ks, conv).double() for _ in range(5)]
    with torch.no_grad():
        for bk in banks:
            for w in bk.weights:
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64))
    srcs = [
        (torch.randn(B, T, D, generator=g, dtype=torch.float64) * (j + 1), lambda s, bk=banks[j]: da.expand_keys(bk(s, None), 1e-6))
        for j in range(5)
    ]
    qg = torch.randn(m_streams, D, generator=g, dtype=torch.float64) * 3
    z_direct, alpha = da.direct(srcs, qg, 1e-6)
    z_two = da.two_phase(srcs[:4], srcs[4], qg, 1e-6)
    torch.testing.assert_close(z_two, z_direct, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(alpha.sum(0), torch.ones_like(alpha[0]))
    # Without a partial: phase 1 alone is the softmax over the completed sources.
    torch.testing.assert_close(da.two_phase(srcs[:4], None, qg, 1e-6), da.direct(srcs[:4], qg, 1e-6)[0], rtol=1e-9, atol=1e-9)


def test_mhc_hres_is_doubly_stochastic():
    site = MHCSite(4, 8, iters=20, scale_init=1.0, res_diag_init=2.0, eps=1e-6, init_std=1.0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        site.w_res.copy_(torch.randn(site.w_res.shape, generator=g) * 0.05)  # logits with std ~0.3 around the diagonal bias
    x = torch.randn(2, 5, 4, 8, generator=g)
    _, _, h_res = site.maps(x)
    torch.testing.assert_close(h_res.sum(-1), torch.ones(2, 5, 4), rtol=0, atol=1e-4)
    torch.testing.assert_close(h_res.sum(-2), torch.ones(2, 5, 4), rtol=0, atol=1e-4)
    assert h_res.dtype == torch.float32 and not torch.allclose(h_res, torch.eye(4).expand_as(h_res), atol=1e-2)


@pytest.mark.parametrize("name", RESIDUAL_PRESETS)
def test_split_layers_equals_whole_forward(name):
    m = build(preset(name), n_layers=4)
    perturb_residual(m)
    x = ids(seq=10)
    whole = m(x)
    layers = m.layers()
    for k in range(1, len(layers)):
        carry = x
        for layer in layers[:k]:
            carry = layer(carry)
        carry = tuple(t.detach().clone() for t in carry)  # as if received from another stage
        for layer in layers[k:]:
            carry = layer(carry)
        assert torch.equal(carry[0], whole[0]) and torch.equal(carry[1], whole[1])


def test_expansion_memo_is_invalidated_by_weight_updates():
    m = build(preset("msar", n_blocks=4), n_layers=2)
    perturb_residual(m)
    x = ids(seq=10)
    carry = m.embed(x)
    out1 = m.blocks[0](carry)
    with torch.no_grad():
        for bank in m.backend._banks.values():
            for w in bank.weights:
                w.mul_(1.5)  # an in-place update, like an optimizer step
    out2 = m.blocks[0](carry)  # same input tensors: the memo must not serve stale expansions
    fresh = m.blocks[0](tuple(t.clone() for t in carry))
    assert all(torch.equal(a, b) for a, b in zip(out2, fresh))
    assert not all(torch.equal(a, b) for a, b in zip(out1, out2))


@pytest.mark.parametrize("s", [0.0, 0.1, 1.0])
def test_conv_init_mixes_identity_and_moving_average(s):
    model = build(preset("msar", conv_init_smoothing=s), n_layers=4)
    banks = model.backend.shared_modules()
    assert banks, "msar built no source expansions"
    x_BTD = torch.randn(2, 16, model.cfg.d_model, dtype=torch.float64)
    for bank in banks.values():
        for k, w in zip([4, 8, 12], bank.weights, strict=True):
            want = torch.full_like(w, s / k)
            want[0] += 1 - s
            torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-7)  # set in fp32, model in fp64
        streams = bank(x_BTD, None)
        # stream r at token t: (1 - s) x_t + s * mean of the last k tokens (zeros before the first)
        for k, y in zip([4, 8, 12], streams[1:]):
            t = 13
            ref = (1 - s) * x_BTD[:, t] + s * x_BTD[:, t - k + 1 : t + 1].sum(1) / k
            torch.testing.assert_close(y[:, t], ref)
        assert torch.equal(streams[0], x_BTD)


@pytest.mark.parametrize("iters", [0, 1, 3, 20])
def test_mhc_sinkhorn_backward_equals_autograd_through_the_iterations(iters):
    """The hand-written Sinkhorn backward against autograd through the plain loop, fp64."""
    from msar_train.residual.mhc import sinkhorn

    g = torch.Generator().manual_seed(iters)
    x = (torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64) * 3).requires_grad_()
    dy = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)
    m = torch.exp(x - x.amax(dim=(-1, -2), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    (want,) = torch.autograd.grad(m, x, dy)
    y = sinkhorn(x, iters)
    (got,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(y.double(), m, rtol=1e-6, atol=1e-7)  # fp32 inside
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_mhc_sinkhorn_refuses_a_second_backward():
    from msar_train.residual.mhc import sinkhorn

    x = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(sinkhorn(x, 3).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_mhc_sum_of_squares_backward_is_differentiable_again():
    from msar_train.residual.mhc import _SumSq

    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SumSq.apply, (x,)) and torch.autograd.gradgradcheck(_SumSq.apply, (x,))
