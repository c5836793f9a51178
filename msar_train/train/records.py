"""Compact records of finished runs: what a study report needs, small enough to commit.

A record is one JSON object per run (no weights)::

    {"format": 1, "status": "finished" | "failed", "name": "data=ptb,residual=msar,trainer.seed=1",
     "experiment": "study_backends", "overrides": [...], "choices": {"residual": "msar", ...},
     "variant": "residual=msar", "corpus": "ptb", "seed": 1, "git_commit": "...",
     "config": {resolved config}, "steps": 400, "tokens": 409600, "flops": 1.2e13,
     "flops_per_token": ..., "non_embedding_flops_per_token": ..., "params": {...},
     "final": {"train_loss": ..., "val_loss": ...},
     "val_curve": [[step, tokens, flops, val_loss], ...], "train_curve": [[step, train_loss], ...],
     "wall_time_s": ..., "mean_step_time_s": ..., "platform": {...}, "error": null}

``variant`` is the job's overrides without the seed and the corpus (the fields a study compares),
``corpus`` the data preset. Built from the run dir's ``config.yaml`` and ``metrics.jsonl``, so a
record can be (re)made from any finished run dir.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

FORMAT_VERSION = 1
RECORD = "record.json"
# Overrides left out of a job's name (configs/train.yaml hydra.job.config.override_dirname.exclude_keys):
# they change how a job runs or logs, not what it computes.
NOT_IN_NAME = (
    "experiment",
    "experiment.records_dir",
    "experiment.notes",
    "trainer.threads",
    "trainer.progress",
    "logger.mode",
    "logger.project",
    "logger.entity",
    "logger.group",
)
# Overrides that do not make a variant either: the repetition (seed) and the corpus the variant runs on.
NOT_VARIANT = (*NOT_IN_NAME, "trainer.seed", "data")


class RecordError(ValueError):
    """A record or run dir that cannot be read; the message names the file."""


def variant_of(overrides: list[str]) -> str:
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in NOT_VARIANT]
    return ",".join(keep) or "default"


def _num(v: Any) -> float | None:
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None  # "nan" / "inf" strings in metrics.jsonl


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RecordError(f"{path}: no metrics file (the run did not log a step)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}:{i}: not JSON ({e})") from None
    return rows


def build_record(
    cfg: DictConfig,
    run_dir: Path,
    *,
    name: str,
    overrides: list[str],
    choices: dict[str, str],
    wall_time_s: float,
    world: int = 1,
    status: str = "finished",
    error: str | None = None,
    git_commit: str = "unknown",
) -> dict[str, Any]:
    """The record of one run from its config and its ``metrics.jsonl`` (curves, final losses).
    Tokens and FLOPs count training only: ``step x tokens per step`` (``world`` = data-parallel ranks)
    and the analytic FLOPs per token."""
    import torch

    from msar_train.model.flops import non_embedding_flops_per_token, training_flops_per_token
    from msar_train.train.params import count_params

    rows = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []
    p = cfg.parallel
    tokens_per_step = p.micro_batch_size * p.grad_accum * world * cfg.data.seq_len
    fpt = training_flops_per_token(cfg.model, cfg.residual, cfg.data.seq_len)
    val_curve, train_curve, step_times = [], [], []
    for r in rows:
        step = int(r["step"])
        if (v := _num(r.get("val/loss"))) is not None:
            val_curve.append([step, step * tokens_per_step, step * tokens_per_step * fpt, v])
        if (t := _num(r.get("train/loss"))) is not None:
            train_curve.append([step, t])
        if (s := _num(r.get("step_time_s"))) is not None:
            step_times.append(s)
    steps = max((int(r["step"]) for r in rows), default=0)
    last_train = next((_num(r.get("train/loss_avg")) for r in reversed(rows) if _num(r.get("train/loss_avg")) is not None), None)
    return {
        "format": FORMAT_VERSION,
        "status": status,
        "name": name,
        "experiment": cfg.experiment.name,
        "overrides": list(overrides),
        "choices": dict(choices),
        "variant": variant_of(list(overrides)),
        "corpus": choices.get("data", cfg.data.corpus),
        "seed": int(cfg.trainer.seed),
        "git_commit": git_commit,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "flops": steps * tokens_per_step * fpt,
        "flops_per_token": fpt,
        "non_embedding_flops_per_token": non_embedding_flops_per_token(cfg.model, cfg.data.seq_len),
        "params": count_params(cfg),
        "final": {"train_loss": last_train, "val_loss": val_curve[-1][3] if val_curve else None},
        "val_curve": val_curve,
        "train_curve": train_curve,
        "wall_time_s": float(wall_time_s),
        "mean_step_time_s": sum(step_times) / len(step_times) if step_times else None,
        "platform": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "machine": platform.machine(),
            "system": platform.system(),
        },
        "error": error,
    }


def write_record(record: dict[str, Any], path: Path) -> Path:
    from msar_train.train.checkpoint import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def read_record(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: unreadable record ({e})") from None
    missing = [k for k in ("format", "status", "variant", "corpus", "seed", "final", "val_curve", "flops") if k not in rec]
    if missing:
        raise RecordError(f"{path}: not a run record (missing {', '.join(missing)})")
    if rec["format"] != FORMAT_VERSION:
        raise RecordError(f"{path}: record format {rec['format']}, this version reads {FORMAT_VERSION}")
    return rec


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every record under the given files / directories (recursively; ``record.json`` in sweep run
    dirs and ``*.json`` in records dirs), deduplicated by (experiment, name): a records-dir copy and
    its run dir's original are the same run."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(p.rglob("*.json"))
        for f in files:
            if f.is_file() and (f.name == RECORD or f.parent.name != ".hydra") and f.suffix == ".json":
                try:
                    rec = read_record(f)
                except RecordError:
                    if p.is_file():
                        raise
                    continue  # other JSON files in a run dir (manifests, wandb)
                rec["_path"] = str(f)
                found.setdefault((rec.get("experiment", ""), rec.get("name", str(f))), rec)
    return list(found.values())
