#!/usr/bin/env python
"""Loss curves of several runs in one PNG: the training key on the left, validation on the right.

    python scripts/plot_runs.py RUN [RUN ...] [--out PNG] [--key train/loss] [--val-key val/loss]

RUN is a run directory (its ``metrics.jsonl`` is read) or a ``metrics.jsonl`` file. Rows without the
key (e.g. image rows, or train rows for the val key) are skipped; "nan"/"inf" strings count as
values. A missing or empty file, or a run without a single value of ``--key``, is an error (exit 2)
naming the file. A half-written last line (a run killed mid-write) is skipped with a warning.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def metrics_file(run: str | Path) -> Path:
    p = Path(run)
    if p.is_dir():
        if not (p / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run}: the run directory has no metrics.jsonl")
        return p / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"{run}: no such run directory or metrics.jsonl file")
    return p


def read_rows(path: Path) -> list[dict]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty (no logged steps)")
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):
                print(f"plot_runs: warning: {path}:{i}: skipping a truncated last line", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{i}: not a JSON object") from None
    return rows


def _number(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in rows:
        v = _number(r.get(key))
        if v is not None and "step" in r:
            steps.append(int(r["step"]))
            values.append(v)
    return steps, values


def plot_runs(runs: list[str | Path], out: str | Path, key: str = "train/loss", val_key: str = "val/loss") -> Path:
    """Write the PNG and return its path; FileNotFoundError / ValueError name the offending file."""
    if not runs:
        raise ValueError("no runs given")
    data = []
    for run in runs:
        path = metrics_file(run)
        rows = read_rows(path)
        train = series(rows, key)
        if not train[0]:
            keys = sorted({k for r in rows for k in r if k != "step"})
            raise ValueError(f"{path}: no {key!r} values (keys: {', '.join(keys) or 'none'})")
        label = path.parent.name if path.name == "metrics.jsonl" else path.stem
        data.append((label, train, series(rows, val_key)))
    labels = [d[0] for d in data]
    if len(set(labels)) < len(labels):  # same folder names: fall back to the paths given
        data = [(str(run), t, v) for run, (_, t, v) in zip(runs, data)]

    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_train, ax_val = fig.subplots(1, 2)
    for k, (label, (ts, tv), (vs, vv)) in enumerate(data):
        color = f"C{k % 10}"
        ax_train.plot(ts, tv, color=color, label=label, linewidth=1.2)
        if vs:
            ax_val.plot(vs, vv, color=color, label=label, marker="o", markersize=3, linewidth=1.2)
    for ax, name in ((ax_train, key), (ax_val, val_key)):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_train.legend(fontsize=8)
    if not any(v[0] for _, _, v in data):
        ax_val.text(0.5, 0.5, f"no {val_key} logged", ha="center", va="center", transform=ax_val.transAxes)
    else:
        ax_val.legend(fontsize=8)
    finite = [x for _, (_, tv), _ in data for x in tv if math.isfinite(x)]
    if finite and max(finite) / max(min(finite), 1e-12) > 20:
        ax_train.set_yscale("log")  # early losses dwarf the rest otherwise
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    ap.add_argument("--out", type=Path, default=Path("loss_curves.png"))
    ap.add_argument("--key", default="train/loss", help="training metric (left panel)")
    ap.add_argument("--val-key", default="val/loss", help="validation metric (right panel)")
    a = ap.parse_args(argv)
    try:
        out = plot_runs(a.runs, a.out, a.key, a.val_key)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_runs: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
