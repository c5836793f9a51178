#!/usr/bin/env python
"""Depth-attention heatmaps of a trained checkpoint, averaged over held-out batches.

    python scripts/plot_depth_attention.py CKPT [--out DIR] [--batches N]

Writes ``DIR/depth_attention.png`` (one panel per stream: rows = target l = 1..L+1, the last being
the output aggregation; columns = sources b_0..b_N; grey = not visible to that target; the partial
b_n^{<l} is drawn in column b_n) and ``DIR/depth_attention.npy`` (the [M, L+1, N+1] array, NaN where
grey). Only backends with depth attention (attnres, msar) record weights; for others it exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from torch import nn

from msar_train.train.monitor import depth_attention_matrix, depth_attention_png, record_residual_diagnostics


def plot_depth_attention(model: nn.Module, batches: Iterable, out_dir: str | Path, title: str = "depth attention") -> list[Path]:
    """Average the recorded depth weights over ``batches`` (data ``Batch`` objects or ids tensors)
    and write one multi-panel PNG plus the raw array next to it. Returns ``[png_path]``.

    Raises ValueError when the model records no depth attention (vanilla, mhc) or no batch is given.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("no batches to average over")
    matrix = depth_attention_matrix(record_residual_diagnostics(model, batches))
    if matrix is None:
        raise ValueError("the model's residual backend records no depth-attention weights (only attnres / msar do)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "depth_attention.npy", matrix)
    return [depth_attention_png(matrix, out / "depth_attention.png", f"{title} (mean over {len(batches)} batches)")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path, help="checkpoint (anything msar_train.train.checkpoint.load_model accepts)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: CKPT's folder / plots)")
    ap.add_argument("--batches", type=int, default=8, help="validation batches to average over")
    a = ap.parse_args(argv)
    if a.batches < 1:
        ap.error("--batches must be >= 1")
    if not a.ckpt.exists():
        print(f"plot_depth_attention: error: {a.ckpt}: no such checkpoint", file=sys.stderr)
        return 2
    from msar_train.data import build_data
    from msar_train.train.checkpoint import load_model

    model, cfg = load_model(a.ckpt)
    mbs = cfg.parallel.micro_batch_size
    data = build_data(cfg.data, model_vocab_size=cfg.model.vocab_size, seed=cfg.trainer.seed, micro_batch_size=mbs)
    if data.val is None:
        print("plot_depth_attention: error: the run's data has no validation split", file=sys.stderr)
        return 2
    out = a.out or (a.ckpt if a.ckpt.is_dir() else a.ckpt.parent) / "plots"
    try:
        paths = plot_depth_attention(model, data.val.batches(a.batches), out, title=f"depth attention: {a.ckpt.name}")
    except ValueError as e:
        print(f"plot_depth_attention: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
