"""One metrics path: JSONL always (one object per logged step), wandb when enabled, rank 0 only.

``RUN_DIR/metrics.jsonl``: one JSON object per ``log`` call, ``{"step": int, "<group>/<name>": float, ...}``;
non-finite values are written as the strings "nan"/"inf"/"-inf"; images passed to ``log`` appear in
the same row as their PNG path (the trainer's rows therefore always hold ``train/loss``), while a
standalone ``log_image`` adds a row ``{"step": int, "<key>": "<png path>"}``. With ``logger.mode`` online/offline the same values go to
wandb, whose files live under ``RUN_DIR/wandb/``. Every other rank constructs the writer but writes
nothing at all (no file, no wandb run).

Resuming: pass the saved ``run_id`` (``writer.run_id``; the checkpoint stores it) and wandb continues
that run (``resume="allow"``); the JSONL file is appended to.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import subprocess
from pathlib import Path
from typing import Any

_ID_CHARS = string.ascii_lowercase + string.digits
WANDB_MODES = ("online", "offline")


def new_run_id() -> str:
    """An 8-character base-36 id, the format wandb generates (``wandb.util.generate_id`` is gone in
    wandb 0.31; this keeps the writer free of a wandb import when wandb is disabled)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(8))


def git_commit(cwd: str | Path | None = None) -> str:
    """``git rev-parse HEAD`` of the source tree (default: this package's checkout); else
    ``$MSAR_GIT_COMMIT`` (set by the Docker image, which has no ``.git``); else "unknown"."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True)
        commit = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return commit or os.environ.get("MSAR_GIT_COMMIT") or "unknown"


def _plain_config(config: Any) -> dict:
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(config)


def _jsonable(v: Any) -> float | str:
    f = float(v)
    return f if math.isfinite(f) else str(f)


class MetricsWriter:
    """``log(step, metrics)``, ``log_image(step, key, png_path)``, ``close()``.

    run_dir: where ``metrics.jsonl`` (and ``wandb/``) go. logger_cfg: ``LoggerConfig`` (mode,
    project, entity, group, name, tags) or None (JSONL only). config: the resolved run config
    (dict or DictConfig); it goes to wandb with ``git_commit`` added. run_id: the wandb run to
    continue (None: a new id, readable as ``.run_id``). rank: only rank 0 writes anything.
    """

    def __init__(self, run_dir: str | Path, logger_cfg=None, config: Any = None, run_id: str | None = None, rank: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.rank = rank
        self.run_id = run_id or new_run_id()
        self._fh = None
        self._wandb = None
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)
        mode = "disabled" if logger_cfg is None else str(logger_cfg.mode)
        if mode in WANDB_MODES:
            self._wandb = self._init_wandb(logger_cfg, mode, config)
        elif mode != "disabled":
            raise ValueError(f"logger.mode={mode!r}: expected one of online, offline, disabled")

    def _init_wandb(self, cfg, mode: str, config: Any):
        import wandb

        run_config = {**_plain_config(config), "git_commit": git_commit()}
        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=cfg.name,
            tags=list(cfg.tags or []),
            mode=mode,
            dir=str(self.run_dir),  # wandb puts its files under RUN_DIR/wandb/
            config=run_config,
            id=self.run_id,
            resume="allow",
        )

    @property
    def wandb_run(self):
        """The live wandb run (None when disabled, on other ranks, or after ``close``)."""
        return self._wandb

    def log(self, step: int, metrics: dict[str, float], images: dict[str, str | Path] | None = None) -> None:
        """One row: the scalars, plus ``images`` (key -> PNG on disk) as paths in the JSONL row and as
        ``wandb.Image`` in the same wandb step."""
        if self._fh is None:
            return
        images = images or {}
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}, **{k: str(v) for k, v in images.items()}}
        self._fh.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            payload = {k: float(v) for k, v in metrics.items()}
            if images:
                import wandb

                payload.update({k: wandb.Image(str(v)) for k, v in images.items()})
            self._wandb.log(payload, step=int(step))

    def log_image(self, step: int, key: str, png_path: str | Path) -> None:
        """Log a PNG already on disk (e.g. ``monitor.heatmap_png``); the JSONL row holds its path."""
        if self._fh is None:
            return
        self._fh.write(json.dumps({"step": int(step), key: str(png_path)}) + "\n")
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Image(str(png_path))}, step=int(step))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
