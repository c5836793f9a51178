"""Single-process training loop (CPU or one GPU).

The loop only talks to the model through ``Transformer`` (a fold over ``layers()``) and ``lm_loss``,
so the DeepSpeed engine can drive the same pieces without a second model definition.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from msar_train.data import build_data
from msar_train.model.transformer import Transformer, lm_loss
from msar_train.train.metrics import MetricsWriter
from msar_train.train.optim import build_optimizer, build_scheduler
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
    train_loss: float
    val_loss: float | None


class Trainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        t = cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        seed_everything(t.seed)
        self.device = torch.device(t.device)
        self.run_dir = Path(t.run_dir) if t.run_dir else default_run_dir(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=True)
        self.data = build_data(cfg.data, model_vocab_size=cfg.model.vocab_size, seed=t.seed, micro_batch_size=t.micro_batch_size)
        self.model = Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=t.seed).to(self.device)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if t.dtype == "bfloat16" else contextlib.nullcontext()
        )
        self.step = 0
        self.metrics = MetricsWriter(self.run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True))
        self._train_iter = iter(self.data.train)

    def _forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch.input_ids_BT.to(self.device)
        doc = None if batch.doc_ids_BT is None else batch.doc_ids_BT.to(self.device)
        pos = None if batch.positions_BT is None else batch.positions_BT.to(self.device)
        with self.autocast:
            out = self.model(ids, doc, pos)
        return lm_loss(out, batch.labels_BT.to(self.device))

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns the step's metrics."""
        t = self.cfg.trainer
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        ce_sum, loss_sum, tokens = 0.0, 0.0, 0
        for _ in range(t.grad_accum):
            batch = next(self._train_iter)
            loss, ce = self._forward(batch)
            (loss / t.grad_accum).backward()
            ce_sum += ce.item()
            loss_sum += loss.item()
            tokens += batch.input_ids_BT.numel()
        grad_norm = self._clip()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        loads = self._update_router_biases()
        self.step += 1
        out = {"train/loss": ce_sum / t.grad_accum, "train/total_loss": loss_sum / t.grad_accum, "lr": lr, "grad_norm": grad_norm, "tokens": tokens}
        if loads:
            out["moe/load_max_over_mean"] = float(np.mean(loads))
        return out

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.trainer.grad_clip if self.cfg.trainer.grad_clip > 0 else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _update_router_biases(self) -> list[float]:
        """Auxiliary-loss-free balancing: one bias update per optimizer step from the step's loads."""
        ratios = []
        for moe in self.model.moe_layers():
            counts = moe.consume_load()
            if counts.sum() > 0:
                ratios.append(float(counts.max() / counts.mean()))
            moe.apply_bias_update(counts)
        return ratios

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean next-token loss over the first ``eval_batches`` validation batches (None: no split)."""
        if self.data.val is None:
            return None
        self.model.eval()
        losses = [self._forward(b)[1].item() for b in self.data.val.batches(self.cfg.trainer.eval_batches)]
        self.model.train()
        return float(np.mean(losses))

    def fit(self) -> FitResult:
        t = self.cfg.trainer
        train_loss, val_loss = float("nan"), None
        window: list[float] = []
        with Progress(t.max_steps, enabled=t.progress) as bar:
            while self.step < t.max_steps:
                t0 = time.perf_counter()
                m = self.train_step()
                dt = time.perf_counter() - t0
                window.append(m["train/loss"])
                m["tokens_per_s"] = m.pop("tokens") / dt
                m["step_time_s"] = dt
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    train_loss = float(np.mean(window))
                    window = []
                    m["train/loss_avg"] = train_loss
                    if self.step % t.eval_every == 0 or self.step == t.max_steps:
                        val_loss = self.evaluate()
                        if val_loss is not None:
                            m["val/loss"] = val_loss
                    self.metrics.log(self.step, m)
                bar.update(self.step, m)
        self.metrics.close()
        return FitResult(self.run_dir, self.step, train_loss, val_loss)
