"""scripts/residual_io.py: the byte counter on known ops, vanilla's exact 3d, the Triton launch
accounting against the kernels' own tensors, and the report end to end on a tiny model."""

import json

import pytest
import torch

from tests.unit.helpers import load_script


def _load():
    return load_script("residual_io")


def _counted(io, fn):
    c = io.IOCounter()
    c.stack.append(True)
    with c:
        fn()
    return c.bytes[("fwd", "read")], c.bytes[("fwd", "write")]


def test_counter_on_known_ops():
    io = _load()
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    assert _counted(io, lambda: a + b) == (2 * 96, 96)  # 24 fp32 each
    assert _counted(io, lambda: a.view(6, 4).t()) == (0, 0)  # views move nothing
    assert _counted(io, lambda: a + b[:, :1]) == (96 + 32, 96)  # a broadcast input counts its own bytes
    assert _counted(io, lambda: a.clone().add_(b)) == (96 + 2 * 96, 96 + 96)  # clone, then in place: self read and written
    assert _counted(io, lambda: torch.zeros_like(a).copy_(b)) == (96, 96 + 96)  # zeros write, copy_ reads only its source
    x = torch.randn(8, 5, dtype=torch.bfloat16)
    assert _counted(io, lambda: x.float()) == (80, 160)


def test_vanilla_counts_its_three_units_exactly():
    io = _load()
    a = io.parse(["--config", "tiny", "--layers", "2", "--seq", "8", "--backends", "vanilla"])
    row = io.run_one("tiny", "vanilla", "torch", a)
    # per branch: read h and f(h), write h + f(h); nothing else, nothing per step
    assert row["counted_fwd"]["reads"] == pytest.approx(2.0) and row["counted_fwd"]["writes"] == pytest.approx(1.0)
    assert row["analytic_fwd"]["total"] == 3.0 and row["paper_fwd"] == 3.0
    assert row["fixed_fwd_bytes"] == pytest.approx(0.0, abs=1e-6)


def test_triton_launch_counts_the_kernel_tensors():
    io = _load()
    td = pytest.importorskip("msar_train.kernels.triton_depth")
    g = torch.Generator().manual_seed(0)
    S, Q, M, B, T, D = 2, 3, 2, 1, 5, 8
    src = torch.randn(S, B, T, D, generator=g)
    W = torch.zeros(S, M, 2, D)
    W[:, :, 0] = 1.0
    qg = torch.randn(Q, M, D, generator=g)
    ks = torch.tensor([1, 2], dtype=torch.int32)
    c = io.IOCounter()
    c.stack.append(True)
    with io.counted_launches(c):
        with c:
            z1, lse = td.phase1(src, W, qg, ks, None, 1e-6, 4, 4)
    launch = c.ops[("fwd", "_p1_fwd")]
    doc = 4  # the 1-element int32 placeholder of "no document mask"
    reads = 4 * (src.numel() + W.numel() + qg.numel()) + ks.numel() * 4 + doc
    writes = 4 * (z1.numel() + lse.numel() + 2 * Q * M * S * B * T)  # z1, lse, logits, inverse RMS
    assert launch == reads + writes
    assert td.Phase1 is not None and td._p1_fwd.__class__.__name__ != "_CountedKernel"  # restored


def test_report_on_a_tiny_model(tmp_path, capsys):
    io = _load()
    out = tmp_path / "io.json"
    args = ["--config", "tiny", "--layers", "2", "--seq", "12", "--kernels", "torch", "--json", str(out)]
    assert io.main([*args, "--backends", "vanilla", "attnres", "msar", "mhc"]) == 0
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == ["vanilla", "attnres", "msar", "mhc"]
    for r in rows[1:]:
        # a function-level fused count is a floor for the op-by-op count; the backward moves more than the forward
        assert r["counted_fwd"]["total"] >= r["analytic_fwd"]["total"] > 3.0, r["backend"]
        assert r["counted_bwd"]["total"] > r["counted_fwd"]["total"], r["backend"]
        assert r["spec_ideal_fwd"]["total"] <= r["analytic_fwd"]["total"] + 1e-9, r["backend"]
    by = {r["backend"]: r for r in rows}
    assert by["msar"]["counted_fwd"]["total"] > by["attnres"]["counted_fwd"]["total"]  # M streams move more
    assert by["mhc"]["paper_fwd"] == 34.0 and by["attnres"]["paper_fwd"] == 5.5
    printed = capsys.readouterr().out
    assert "| backend | kernel | paper |" in printed and "config=tiny" in printed


def test_batch_must_leave_a_difference():
    io = _load()
    with pytest.raises(ValueError, match="--batch 1"):
        io.run_one("tiny", "vanilla", "torch", io.parse(["--batch", "1"]))
