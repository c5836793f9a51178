#!/usr/bin/env python
"""Train every residual preset for the same steps on the same data and print a loss table.

    python scripts/compare_backends.py --steps 200 [--model tiny] [--residuals msar vanilla ...] [--json OUT]
                                       [-- extra hydra overrides]

Each run goes through ``msar-train`` (same seed, same data order); the table reports the final
train loss (mean of the last log window), the validation loss and the wall time per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from msar_train.train.cli import main as train_main
from msar_train.train.metrics import read_metrics

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "residual").glob("*.yaml"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--residuals", nargs="*", default=PRESETS)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--out", type=Path, help="keep run dirs here (default: a temp dir)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    root = a.out or Path(tempfile.mkdtemp(prefix="msar-compare-"))
    rows = []
    for res in a.residuals:
        rd = root / res
        t0 = time.perf_counter()
        over = [f"model={a.model}", f"residual={res}", f"trainer.max_steps={a.steps}", f"trainer.run_dir={rd}", "trainer.progress=false"]
        if train_main(over + a.overrides) != 0:
            print(f"{res}: training failed", file=sys.stderr)
            return 1
        wall = time.perf_counter() - t0
        m = read_metrics(rd / "metrics.jsonl")
        last = m[-1]
        rows.append(
            {
                "residual": res,
                "steps": last["step"],
                "train_loss": last["train/loss_avg"],
                "val_loss": last.get("val/loss"),
                "s_per_step": wall / a.steps,
            }
        )
    print("\n| residual | steps | train loss | val loss | s/step (incl. eval) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['residual']} | {r['steps']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | {r['s_per_step']:.3f} |")
    print(json.dumps(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
