"""The training loop. All optimisation goes through the DeepSpeed ``Engine`` (one rank included);
this file only feeds batches, schedules evaluation and writes metrics on the rank that owns the loss.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from msar_train.data import build_data
from msar_train.parallel.engine import Engine
from msar_train.train.metrics import MetricsWriter
from msar_train.train.progress import Progress


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_run_dir(cfg: DictConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.experiment.name}-{cfg.residual.name}-{cfg.model.name}-{stamp}"


@dataclass
class FitResult:
    run_dir: Path
    steps: int
    train_loss: float | None  # None on ranks that do not own the loss
    val_loss: float | None
    owns_loss: bool


class Trainer:
    def __init__(self, cfg: DictConfig):
        import deepspeed.comm as dist

        self.cfg = cfg
        t = cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        seed_everything(t.seed)
        self.engine = Engine(cfg)
        e = self.engine
        # One run dir for all ranks (the default has a timestamp): rank 0 decides.
        box = [str(Path(t.run_dir) if t.run_dir else default_run_dir(cfg))]
        dist.broadcast_object_list(box, src=0)
        self.run_dir = Path(box[0])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if e.rank == 0:
            OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=True)
        p = cfg.parallel
        self.data = build_data(
            cfg.data,
            model_vocab_size=cfg.model.vocab_size,
            seed=t.seed,
            micro_batch_size=p.micro_batch_size,
            rank=e.dp_rank,
            world=e.dp_world,
        )
        self.step = 0
        self.metrics = MetricsWriter(self.run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True)) if e.owns_loss else None
        self._train_iter = iter(self.data.train)

    def train_step(self) -> dict[str, float]:
        p = self.cfg.parallel
        batches = [next(self._train_iter) for _ in range(p.grad_accum)]
        r = self.engine.train_step(batches)
        self.step += 1
        tokens = sum(b.input_ids_BT.numel() for b in batches) * self.engine.dp_world
        out = {"train/total_loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens": tokens}
        if r.ce is not None:
            out["train/loss"] = r.ce
        if r.moe_load_ratio is not None:
            out["moe/load_max_over_mean"] = r.moe_load_ratio
        return out

    def evaluate(self) -> float | None:
        """Mean next-token loss over the first ``eval_batches`` validation batches (None: no split,
        or a rank that does not own the loss)."""
        if self.data.val is None:
            return None
        return self.engine.eval_loss(list(self.data.val.batches(self.cfg.trainer.eval_batches)))

    def fit(self) -> FitResult:
        t = self.cfg.trainer
        owner = self.engine.owns_loss
        train_loss, val_loss = None, None
        window: list[float] = []
        with Progress(t.max_steps, enabled=t.progress and owner) as bar:
            while self.step < t.max_steps:
                t0 = time.perf_counter()
                m = self.train_step()
                dt = time.perf_counter() - t0
                m["tokens_per_s"] = m.pop("tokens") / dt
                m["step_time_s"] = dt
                if "train/loss" in m:
                    window.append(m["train/loss"])
                last = self.step == t.max_steps
                if self.step % t.eval_every == 0 or last:
                    v = self.evaluate()
                    if v is not None:
                        val_loss = m["val/loss"] = v
                if self.step % t.log_every == 0 or last:
                    if window:
                        train_loss = m["train/loss_avg"] = float(np.mean(window))
                        window = []
                    if self.metrics is not None:
                        self.metrics.log(self.step, m)
                if owner:
                    bar.update(self.step, m)
        if self.metrics is not None:
            self.metrics.close()
        return FitResult(self.run_dir, self.step, train_loss, val_loss, owner)
