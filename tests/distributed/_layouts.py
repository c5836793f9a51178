"""The layout runs shared by test_layouts.py (consolidation) and test_relayout.py (resume under
another layout): the same tiny 4-step job under every supported layout, made once per session.

Global batch 4 samples per step everywhere (micro 2 x accum x DP), so every layout sees the same samples
per step (``_launch.py``) and trains the same model to fp32 rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.distributed._launch import run, torchrun_cmd

WORKER = Path(__file__).with_name("_layout_worker.py")
LAYOUT_COMMON = [
    "model=tiny",
    "residual=msar",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "trainer.max_steps=4",
    "trainer.warmup_steps=1",  # the cosine decay runs inside the 4 steps: a wrong schedule on resume shows
    "trainer.save_every=2",
    "trainer.log_every=1",
    "trainer.eval_every=4",
    "trainer.eval_batches=1",
    "trainer.progress=false",
    "logger.mode=disabled",
    "logger.residual_every=0",
    "logger.heatmap_every=0",
]
# name -> (ranks, overrides). Global batch 4 samples per step everywhere (micro 2 x accum x DP).
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["parallel=single", "parallel.grad_accum=2"]),
    "zero2": (2, ["parallel=dp_zero2", "parallel.grad_accum=1"]),
    "pp2": (2, ["parallel=pp2", "parallel.grad_accum=2"]),
    "pp2_v2": (2, ["parallel=pp2", "parallel.virtual_stages=2", "parallel.grad_accum=2"]),
    "ep2": (2, ["parallel=ep2", "parallel.grad_accum=1"]),
    "pp2_ep2": (4, ["parallel=pp2_ep2", "parallel.grad_accum=1"]),
    # without ZeRO: the optimizer in per-EP-rank expp_rank_* files, named by the client state
    "pp2_ep2_z0": (4, ["parallel=pp2_ep2", "parallel.zero_stage=0", "parallel.grad_accum=1"]),
}


def train_layout(run_dir: Path, nproc: int, *overrides: str) -> Path:
    """Run the worker (``nproc`` ranks; one rank: no launcher) into ``run_dir``."""
    args = [str(run_dir), *LAYOUT_COMMON, *overrides, f"trainer.run_dir={run_dir}"]
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), *args]
    else:
        cmd = torchrun_cmd(nproc, WORKER, *args)
    run(cmd, f"layout {overrides}")
    return run_dir


class LayoutRuns:
    def __init__(self, root: Path):
        self.root = root
        self._done: dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self._done:
            nproc, overrides = LAYOUTS[name]
            self._done[name] = train_layout(self.root / name, nproc, *overrides)
        return self._done[name]


def rows(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/total_loss" in r]
