"""heatmap_png, scripts/plot_depth_attention.py and scripts/plot_runs.py write real PNGs and fail clearly."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from msar_train.train.monitor import heatmap_png
from tests.unit.helpers import build, ids, perturb_residual, preset

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PNG = b"\x89PNG\r\n\x1a\n"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _is_png(path: Path, min_bytes: int = 3000) -> bool:
    data = Path(path).read_bytes()
    return data[:8] == PNG and len(data) > min_bytes


def test_heatmap_png(tmp_path):
    mats = np.random.default_rng(0).random((3, 5, 4))
    mats[:, 0, 1:] = np.nan
    out = heatmap_png(mats, tmp_path / "sub" / "h.png", "three streams")
    assert _is_png(out)
    assert _is_png(heatmap_png([np.full((2, 2), -1.0)], tmp_path / "neg.png", "one panel, constant"))
    with pytest.raises(ValueError, match="2-D"):
        heatmap_png([np.zeros(3)], tmp_path / "bad.png", "x")


def test_plot_depth_attention(tmp_path):
    pda = _script("plot_depth_attention")
    m = build(preset("msar", n_blocks=2), n_layers=2, dtype=torch.float32)
    perturb_residual(m)
    paths = pda.plot_depth_attention(m, [ids(seed=1), ids(seed=2)], tmp_path / "plots")
    assert paths == [tmp_path / "plots" / "depth_attention.png"] and _is_png(paths[0])
    A = np.load(tmp_path / "plots" / "depth_attention.npy")
    assert A.shape == (4, 5, 3)
    np.testing.assert_allclose(np.nansum(A, axis=2), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="no depth-attention"):
        pda.plot_depth_attention(build(preset("vanilla"), n_layers=2, dtype=torch.float32), [ids()], tmp_path / "v")
    with pytest.raises(ValueError, match="no batches"):
        pda.plot_depth_attention(m, [], tmp_path / "e")


def test_plot_depth_attention_cli_missing_checkpoint(tmp_path, capsys):
    pda = _script("plot_depth_attention")
    assert pda.main([str(tmp_path / "nope.pt")]) == 2
    assert "nope.pt: no such checkpoint" in capsys.readouterr().err


def _write_run(run_dir: Path, steps: int, scale: float, val: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "train/loss": scale * 5.0 / s, "lr": 1e-3}
        if val and s % 5 == 0:
            row["val/loss"] = scale * 5.5 / s
        rows.append(row)
    rows.append({"step": steps, "residual/depth_attention": "plots/x.png"})  # an image row
    rows.append({"step": steps + 1, "train/loss": "nan"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_plot_runs(tmp_path, capsys):
    pr = _script("plot_runs")
    a = _write_run(tmp_path / "msar", 20, 1.0)
    b = _write_run(tmp_path / "vanilla", 15, 1.2, val=False)
    out = pr.plot_runs([a, b / "metrics.jsonl"], tmp_path / "curves.png")
    assert _is_png(out)
    assert pr.main([str(a), str(b), "--out", str(tmp_path / "cli.png"), "--key", "lr"]) == 0
    assert _is_png(tmp_path / "cli.png", min_bytes=1000)
    # No run has validation rows: still a plot (the panel says so).
    assert _is_png(pr.plot_runs([b], tmp_path / "noval.png"))
    # A half-written last line is skipped with a warning.
    with open(a / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 21, "train/lo')
    assert _is_png(pr.plot_runs([a], tmp_path / "trunc.png"))
    assert "truncated last line" in capsys.readouterr().err


def test_plot_runs_errors(tmp_path, capsys):
    pr = _script("plot_runs")
    good = _write_run(tmp_path / "good", 5, 1.0)
    with pytest.raises(FileNotFoundError, match="missing"):
        pr.plot_runs([good, tmp_path / "missing"], tmp_path / "x.png")
    assert pr.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "plot_runs: error:" in err and "missing" in err and "metrics.jsonl" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        pr.plot_runs([tmp_path / "empty"], tmp_path / "x.png")
    (tmp_path / "nofile").mkdir()
    with pytest.raises(FileNotFoundError, match="nofile: the run directory has no metrics.jsonl"):
        pr.plot_runs([tmp_path / "nofile"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="no 'val/bpb' values .*train/loss"):
        pr.plot_runs([good], tmp_path / "x.png", key="val/bpb")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        pr.plot_runs([bad], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
