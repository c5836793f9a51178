"""One metrics path: JSONL always (one object per logged step), wandb when enabled."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: Path, logger_cfg=None, config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = open(self.path, "a", buffering=1)
        self._wandb = None
        if logger_cfg is not None and logger_cfg.mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=logger_cfg.project,
                entity=logger_cfg.entity,
                group=logger_cfg.group,
                name=logger_cfg.name,
                tags=list(logger_cfg.tags),
                mode=logger_cfg.mode,
                dir=str(run_dir),
                config=config,
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (float(v) if math.isfinite(float(v)) else str(float(v))) for k, v in metrics.items()}}
        self._fh.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._fh.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
