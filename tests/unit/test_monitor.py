"""Residual diagnostics behind the protocol and the monitor's metrics (residual + MoE)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from msar_train.data.loader import Batch
from msar_train.residual.base import Diagnosable
from msar_train.residual.diagnostics import diagnosable_modules, record_diagnostics
from msar_train.residual.layout import BlockLayout
from msar_train.train.monitor import (
    DEPTH_HEATMAP,
    collect_residual_metrics,
    moe_metrics,
    record_residual_diagnostics,
    residual_metrics,
)
from tests.unit.helpers import build, ids, perturb_residual, preset

N_LAYERS = 3  # L = 6 branches


def _visible(n_branches: int, n_blocks: int) -> np.ndarray:
    """[L+1, N+1] bool: which sources b_j target l reads (the partial counts as b_n)."""
    lay = BlockLayout(n_branches, n_blocks)
    out = np.zeros((n_branches + 1, n_blocks + 1), dtype=bool)
    for t in range(1, n_branches + 1):
        n = lay.block_of(t)
        out[t - 1, : n + (0 if lay.is_first(t) else 1)] = True
    out[n_branches, :] = True  # output aggregation: every completed summary
    return out


@pytest.mark.parametrize(
    "name, over, streams, n_blocks",
    [("msar", {"n_blocks": 3}, 4, 3), ("attnres", {"n_blocks": 2}, 1, 2), ("msar_full", {}, 4, 6), ("msar_m2", {"n_blocks": 3}, 2, 3)],
)
def test_depth_diagnostics_shapes_and_normalisation(name, over, streams, n_blocks):
    m = build(preset(name, **over), n_layers=N_LAYERS, dtype=torch.float32)
    perturb_residual(m, scale=0.5)
    scalars, heat = collect_residual_metrics(m, ids(batch=2, seq=12))
    L = 2 * N_LAYERS
    A = heat[DEPTH_HEATMAP]
    assert A.shape == (streams, L + 1, n_blocks + 1)
    vis = _visible(L, n_blocks)
    for r in range(streams):
        assert np.array_equal(np.isfinite(A[r]), vis), f"stream {r}: NaN pattern != visible sources"
        np.testing.assert_allclose(np.nansum(A[r], axis=1), 1.0, atol=1e-5)
    assert (A[np.isfinite(A)] >= 0).all()
    # Perturbed queries: weights are no longer uniform somewhere.
    assert np.nanmax(np.abs(A - np.nanmean(A, axis=2, keepdims=True))) > 1e-3
    fusion = {k for k in scalars if k.startswith("residual/fusion_weight/")}
    if streams > 1:
        assert fusion == {f"residual/fusion_weight/layer{t}/stream{r}" for t in range(1, L + 2) for r in range(streams)}
        assert all(0 < scalars[k] < 1 for k in fusion)
    else:
        assert not fusion  # one stream: nothing to fuse
    ent = [v for k, v in scalars.items() if k.startswith("residual/depth_entropy/layer")]
    assert ent and all(0 <= e <= 1 + 1e-6 for e in ent)
    assert "residual/depth_entropy/layer1/stream0" not in scalars  # branch 1 has one source
    assert "residual/mhc_doubly_stochastic_err" not in scalars


def test_depth_weights_uniform_at_init():
    m = build(preset("msar", n_blocks=3), n_layers=N_LAYERS, dtype=torch.float32)
    scalars, heat = collect_residual_metrics(m, ids())
    A = heat[DEPTH_HEATMAP]
    counts = np.isfinite(A[0]).sum(1)
    np.testing.assert_allclose(A[:, np.arange(A.shape[1]), 0], np.broadcast_to(1.0 / counts, A.shape[:2]), rtol=1e-5)
    assert scalars["residual/depth_entropy/mean"] == pytest.approx(1.0, abs=1e-5)
    h = [v for k, v in scalars.items() if k.startswith("residual/fusion_weight/")]
    assert h and all(abs(x - 0.5) < 0.01 for x in h)  # sigmoid(~0)


def test_recorded_alpha_matches_direct_softmax_per_token():
    """The heatmap row of a target is the token-mean of that target's softmax over its sources."""
    m = build(preset("attnres", n_blocks=2), n_layers=2, dtype=torch.float64)
    perturb_residual(m)
    x = ids(batch=2, seq=8)
    # Reference: softmax_j(w_l . RMSNorm_l(v_j)) for the output target, from the final state.
    carry = m.embed(x)
    for blk in m.blocks:
        carry = blk(carry)
    state = carry[1:]
    tgt = m.head.exit.target
    logits = torch.stack([(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + tgt.eps)) @ tgt.qg()[0] for s in state])
    ref = torch.softmax(logits, 0).mean((1, 2)).detach().numpy()
    A = collect_residual_metrics(m, x)[1][DEPTH_HEATMAP]
    np.testing.assert_allclose(A[0, -1], ref, rtol=1e-6)  # recorded in fp32


def test_mhc_diagnostics():
    m = build(preset("mhc"), n_layers=N_LAYERS, dtype=torch.float32)
    scalars, heat = collect_residual_metrics(m, ids())
    assert heat == {}
    assert 0 <= scalars["residual/mhc_doubly_stochastic_err"] < 1e-4
    diag = {k: v for k, v in scalars.items() if k.startswith("residual/mhc_hres_diag/")}
    assert set(diag) == {f"residual/mhc_hres_diag/layer{t}" for t in range(1, 2 * N_LAYERS + 1)}
    assert all(0.25 < v < 1 for v in diag.values())  # near identity (b_res = 2 I), not uniform
    assert not any(k.startswith("residual/fusion_weight") for k in scalars)


def test_vanilla_records_nothing():
    m = build(preset("vanilla"), n_layers=2, dtype=torch.float32)
    assert collect_residual_metrics(m, ids()) == ({}, {})


@pytest.mark.parametrize("name", ["msar", "mhc"])
def test_recording_off_stores_nothing(name):
    m = build(preset(name, **({"n_blocks": 2} if name == "msar" else {})), n_layers=2, dtype=torch.float32)
    mods = diagnosable_modules(m)
    assert mods and all(isinstance(mod, Diagnosable) for _, mod in mods)
    m(ids())
    assert all(mod.diagnostics() == {} and "_diag_acc" not in mod.__dict__ for _, mod in mods)
    with record_diagnostics(m) as rec:
        m(ids())
        assert all(mod.recording for _, mod in mods)
        assert any(mod.diagnostics() for _, mod in mods)
    assert rec.records
    # After the block: flags back to the class default, no tensors left behind.
    assert all(not mod.recording and mod.diagnostics() == {} and "recording" not in mod.__dict__ for _, mod in mods)
    m(ids())
    assert all(mod.diagnostics() == {} for _, mod in mods)


def test_recording_averages_over_batches_and_leaves_training_state_alone():
    m = build(preset("msar", n_blocks=2), n_layers=2, dtype=torch.float32)  # fp64 CPU conv1d is slow
    perturb_residual(m)
    m.train()
    a, b = ids(seed=1), ids(seed=2)
    m(a)  # a training forward: load counters and last_load reflect it
    counts = [moe.load_counts.clone() for moe in m.moe_layers()]
    last = [moe.last_load for moe in m.moe_layers()]
    both = record_residual_diagnostics(m, [a, b])
    one_a, one_b = record_residual_diagnostics(m, a), record_residual_diagnostics(m, b)
    for d, da_, db_ in zip(both, one_a, one_b):
        for k in d.values:
            torch.testing.assert_close(d.values[k], (da_.values[k] + db_.values[k]) / 2)
    assert m.training
    assert all(torch.equal(c, moe.load_counts) for c, moe in zip(counts, m.moe_layers()))
    assert all(lo is moe.last_load for lo, moe in zip(last, m.moe_layers()))


def test_document_masked_batches():
    m = build(preset("msar", n_blocks=2), n_layers=2, dtype=torch.float32, document_mask=True)
    x = ids(batch=1, seq=12)
    doc = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.tensor([list(range(5)) + list(range(7))])
    batch = Batch(input_ids_BT=x, labels_BT=x, doc_ids_BT=doc, positions_BT=pos)
    scalars, heat = collect_residual_metrics(m, batch)
    assert heat[DEPTH_HEATMAP].shape == (4, 5, 3) and scalars


def test_residual_metrics_reads_keys_not_backend_names():
    from msar_train.residual.diagnostics import SiteDiagnostics

    recs = [
        SiteDiagnostics(
            "x", 1, {"depth_alpha": torch.ones(1, 2), "depth_entropy": torch.zeros(2), "fusion_weights": torch.tensor([0.2, 0.8])}
        ),
        SiteDiagnostics("y", 2, {"depth_alpha": torch.tensor([[0.25, 0.5], [0.75, 0.5]]), "depth_entropy": torch.tensor([0.5, 1.0])}),
        SiteDiagnostics("z", None, {"mhc_ds_err": torch.tensor(0.01)}),
        SiteDiagnostics("w", 3, {"mhc_ds_err": torch.tensor(0.03), "mhc_hres": torch.eye(2)}),
    ]
    s, h = residual_metrics(recs)
    assert s["residual/fusion_weight/layer1/stream1"] == pytest.approx(0.8)
    assert s["residual/depth_entropy/layer2/stream1"] == 1.0 and s["residual/depth_entropy/mean"] == 0.75
    assert s["residual/mhc_doubly_stochastic_err"] == pytest.approx(0.03)
    assert s["residual/mhc_hres_diag/layer3"] == 1.0
    np.testing.assert_allclose(h[DEPTH_HEATMAP][1], [[1.0, np.nan], [0.5, 0.5]])


def test_moe_metrics():
    m = build(preset("vanilla"), n_layers=3, dtype=torch.float32)  # first_k_dense=1: MoE in blocks 1, 2
    before = moe_metrics(m)
    assert before == {"moe/layer1/router_bias_norm": 0.0, "moe/layer2/router_bias_norm": 0.0}  # no forward yet
    m(ids(batch=4, seq=16))
    with torch.no_grad():
        m.blocks[2].ffn.router.expert_bias.copy_(torch.tensor([3.0, 0.0, 0.0, -4.0]))
    out = moe_metrics(m)
    assert out["moe/layer2/router_bias_norm"] == pytest.approx(5.0)
    for i in (1, 2):
        load = m.blocks[i].ffn.last_load.double()
        assert out[f"moe/layer{i}/load_max_over_mean"] == pytest.approx(float(load.max() / load.mean()))
        p = load / load.sum()
        ent = -(p * p.clamp_min(1e-30).log()).sum() / math.log(4)
        assert out[f"moe/layer{i}/load_entropy"] == pytest.approx(float(ent))
        assert 0 < out[f"moe/layer{i}/load_entropy"] <= 1 and out[f"moe/layer{i}/load_max_over_mean"] >= 1
    assert out["moe/worst/load_max_over_mean"] == max(out[f"moe/layer{i}/load_max_over_mean"] for i in (1, 2))
    assert out["moe/worst/load_entropy"] == min(out[f"moe/layer{i}/load_entropy"] for i in (1, 2))
