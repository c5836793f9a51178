"""The training loop. All optimisation goes through the DeepSpeed ``Engine`` (one rank included);
this file feeds batches, schedules evaluation, diagnostics and checkpoints, handles stop signals and
skipped steps, and writes metrics on the rank that owns the loss.

Checkpoints: ``RUN_DIR/checkpoints/`` (``train/checkpoint.py``), every ``trainer.save_every`` steps,
at the end, and when SIGTERM / SIGINT asked the run to stop. Resume: ``trainer.resume``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from msar_train.data import build_data
from msar_train.data.corpora import CorpusFetchError
from msar_train.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT_WRITE, CheckpointWriteError, InputError, ReportedElsewhere
from msar_train.parallel.engine import Engine
from msar_train.train import checkpoint as ckpt
from msar_train.train import reshard
from msar_train.train.metrics import MetricsWriter, git_commit, new_run_id
from msar_train.train.progress import Progress
from msar_train.train.rundir import RunLock, model_differences, set_aside_metrics


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_run_dir(cfg: DictConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.experiment.name}-{cfg.residual.name}-{cfg.model.name}-{stamp}"


class TrainingHalted(RuntimeError):
    """Too many consecutive skipped steps (``trainer.max_consecutive_skips``)."""


@dataclass
class FitResult:
    run_dir: Path
    steps: int
    train_loss: float | None  # None on ranks that do not own the loss
    val_loss: float | None
    owns_loss: bool
    stopped_by_signal: str | None = None  # "SIGTERM" / "SIGINT" when a signal ended the run early
    resumed_from: Path | None = None


# Dense bf16 peak per GPU (TFLOP/s) by device-name substring, for MFU; logger.peak_tflops overrides.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "B200": 2250.0}


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after ``last_step`` (a resumed run re-logs them, bit for bit)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill -9
            continue
        if int(row.get("step", 0)) <= last_step:
            keep.append(line)
    ckpt.atomic_write_text(path, "".join(k + "\n" for k in keep))


def _merge_moe(parts: list[dict[str, float]]) -> dict[str, float]:
    """MoE metrics of several pipeline stages: per-layer keys united, the worst-layer keys recomputed."""
    out = {k: v for p in parts for k, v in p.items() if not k.startswith("moe/worst/")}
    ratios = [v for k, v in out.items() if k.endswith("/load_max_over_mean")]
    ents = [v for k, v in out.items() if k.endswith("/load_entropy")]
    if ratios:
        out["moe/worst/load_max_over_mean"] = max(ratios)
        out["moe/worst/load_entropy"] = min(ents)
    return out


class Trainer:
    def __init__(self, cfg: DictConfig):
        import deepspeed.comm as dist

        self.cfg = cfg
        t = cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        seed_everything(t.seed)
        self.engine = Engine(cfg)
        # One run dir for all ranks (the default has a timestamp): rank 0 decides.
        box = [str(Path(t.run_dir) if t.run_dir else default_run_dir(cfg))]
        dist.broadcast_object_list(box, src=0)
        self.run_dir = Path(box[0])
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics = None
        self.lock = RunLock(self.run_dir)
        try:
            self._collective_check(self._take_run_dir)
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        cfg, t, e, p = self.cfg, self.cfg.trainer, self.engine, self.cfg.parallel
        import deepspeed.comm as dist

        try:
            self.data = build_data(
                cfg.data,
                model_vocab_size=cfg.model.vocab_size,
                seed=t.seed,
                micro_batch_size=p.micro_batch_size,
                rank=e.dp_rank,
                world=e.dp_world,
            )
        except (ValueError, OSError, CorpusFetchError) as err:  # the data the config names: user input
            raise err if isinstance(err, InputError) else InputError(str(err)) from err
        self.step = 0
        self.skipped_total = 0
        self.consecutive_skips = 0
        self._last_saved = -1
        self._stop_signal: int | None = None
        # Nothing is written to the run dir before the resume decision is validated (rundir.py).
        self.resumed_from = self._resume()
        if e.rank == 0:
            OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=True)
        box = [self._run_id or new_run_id()]
        dist.broadcast_object_list(box, src=0)  # also orders rank 0's run-dir writes before the metrics writer
        self.run_id = box[0]
        if e.owns_loss:
            if self.resumed_from is not None:
                _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
            self.metrics = MetricsWriter(self.run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True), run_id=self.run_id)
        self._train_iter = iter(self.data.train)
        self._flops_per_token = self._estimate_flops_per_token()

    def close(self) -> None:
        """Release the run dir (idempotent); ``fit`` ends with it."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.lock.release()

    def _collective_check(self, fn):
        """Run ``fn`` on rank 0; its ``InputError`` is raised there and every other rank raises
        ``ReportedElsewhere`` (no message of its own). Returns ``fn``'s result on every rank."""
        import deepspeed.comm as dist

        box: list = [None, None]
        if self.engine.rank == 0:
            try:
                box = [fn(), None]
            except InputError as err:
                box = [None, err]
        if self.engine.world > 1:
            dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            if self.engine.rank == 0:
                raise box[1]
            raise ReportedElsewhere(EXIT_BAD_INPUT)
        return box[0]

    def _take_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()

    # ------------------------------------------------------------------------------- resume
    def _decide_resume(self) -> str | None:
        """Rank 0: the checkpoint to continue (``trainer.resume``) after checking that it holds this
        run's model; for a fresh start the run dir's old metrics are set aside (``rundir.py``)."""
        t = self.cfg.trainer
        found = ckpt.resolve_resume(t.resume, self.ckpt_root)
        if found is None:
            if str(t.resume).strip() == "none":
                valid = [d for d in ckpt.checkpoint_dirs(self.ckpt_root) if (d / ckpt.MANIFEST).is_file()]
                if valid:
                    raise InputError(
                        f"trainer.resume=none: {self.ckpt_root} holds checkpoints of an earlier run (newest {valid[0].name}); "
                        "a fresh start would mix two runs' checkpoints. Use trainer.resume=auto to continue it, another "
                        "trainer.run_dir, or delete them"
                    )
            set_aside_metrics(self.run_dir)
            return None
        manifest = ckpt.verify(found, hash_files=False)
        saved, saved_tok = ckpt.saved_config(found, manifest)
        diffs = model_differences(saved, OmegaConf.to_container(self.cfg, resolve=True), saved_tok, self.data.meta.get("tokenizer_sha256"))
        if diffs:
            raise ckpt.CheckpointError(
                f"{found}: trained with another model than this run's config; nothing was loaded (trainer.resume={t.resume}). "
                "Differences:\n  " + "\n  ".join(diffs)
            )
        saved_layout = reshard.layout_of(saved.get("parallel", {}), ckpt.saved_world_size(found, manifest))
        return str(found), saved_layout != self._layout()

    def _layout(self) -> dict:
        return reshard.layout_of(OmegaConf.to_container(self.cfg.parallel, resolve=True), self.engine.world)

    def _resume(self) -> Path | None:
        """Collective: rank 0 picks and checks the checkpoint, every rank loads it."""
        self._run_id = None
        decided = self._collective_check(self._decide_resume)
        if decided is None:
            return None
        where, relayout = Path(decided[0]), decided[1]
        if relayout:  # another layout wrote it: through the one logical model (train/reshard.py)
            logical = reshard.read_state(where)
            reshard.apply_state(self.engine, logical)
            state = logical.client
            if self.engine.owns_loss:
                old = reshard.layout_of(logical.cfg.parallel, len(state.get("rng") or []) or None)
                changed = ", ".join(f"{k} {old[k]} -> {v}" for k, v in self._layout().items() if old.get(k) != v)
                print(f"msar-train: {where} was written under another layout ({changed}); resharded", flush=True)
        else:
            state = self.engine.load(where.parent, where.name).get(ckpt.CLIENT_KEY)
        if state is None:
            raise ckpt.CheckpointError(f"{where}: a DeepSpeed checkpoint without msar training state (not written by msar-train)")
        self.step = int(state["step"])
        self._last_saved = self.step
        self.skipped_total = int(state.get("skipped_total", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        try:
            self.data.train.load_state_dict(state["train_loader"], relayout=True)  # another micro-batch split too
        except ValueError as err:
            raise ckpt.CheckpointError(f"{where}: {err}") from None
        rngs = state["rng"]
        ckpt.set_rng_state(rngs[self.engine.rank] if len(rngs) == self.engine.world else rngs[0])
        self._run_id = state.get("wandb_run_id")
        if self.engine.owns_loss:
            print(f"msar-train: resumed from {where} (step {self.step})", flush=True)
        return where

    # --------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Collective. DeepSpeed writes its files, every rank hashes a share of them, rank 0 writes the
        manifest, then the ``latest`` pointer (both atomically), then prunes to ``keep_last``.

        A write that fails for an OS reason (disk full, I/O error, permission) on any rank removes the
        partial directory, leaves the previous checkpoint and ``latest`` as they were, and raises
        ``CheckpointWriteError`` (exit 4) on the ranks that failed, ``ReportedElsewhere`` on the others."""
        import deepspeed.comm as dist

        e, t = self.engine, self.cfg.trainer
        tag = ckpt.tag_for(self.step)
        target = self.ckpt_root / tag
        err = None
        if e.rank == 0:
            try:
                self.ckpt_root.mkdir(parents=True, exist_ok=True)
                if target.exists():  # a stale or partial save of this step: never mix its files or manifest in
                    shutil.rmtree(target)
            except OSError as x:
                err = x
        self._agree_on_save(err, target)
        rngs = [None] * e.world
        dist.all_gather_object(rngs, ckpt.rng_state())
        config = OmegaConf.to_container(self.cfg, resolve=True)
        client = {
            ckpt.CLIENT_KEY: {
                "format": ckpt.FORMAT_VERSION,
                "step": self.step,
                "skipped_total": self.skipped_total,
                "consecutive_skips": self.consecutive_skips,
                "train_loader": self.data.train.state_dict(),
                "rng": rngs,
                "config": config,
                "git_commit": git_commit(),
                "wandb_run_id": self.run_id,
                "param_names": reshard.optimizer_param_names(e),  # this rank's; a layout change reads them
            }
        }
        try:
            e.save(self.ckpt_root, tag, client)  # ends with a barrier: every file is on disk
        except Exception as x:  # noqa: BLE001 - an OS failure is reported below, anything else re-raised
            err = ckpt.write_failure(x, self.ckpt_root)
            if err is None:
                raise
            if e.world > 1:  # the ranks that wrote their files wait in DeepSpeed's closing barrier
                dist.barrier()
        self._agree_on_save(err, target)
        files = ckpt.payload_files(target) if e.rank == 0 else None
        box = [files]
        dist.broadcast_object_list(box, src=0)
        mine = ckpt.file_entries(target, box[0][e.rank :: e.world])
        shares = [None] * e.world
        dist.all_gather_object(shares, mine)
        if e.rank == 0:
            entries = {k: v for s in shares for k, v in s.items()}
            try:
                ckpt.write_manifest(
                    target, self.step, entries, config=config, tokenizer_sha256=self.data.meta.get("tokenizer_sha256"), world_size=e.world
                )
                ckpt.atomic_write_text(self.ckpt_root / ckpt.LATEST, tag)
            except OSError as x:
                err = x
        self._agree_on_save(err, target)
        if e.rank == 0:
            ckpt.prune(self.ckpt_root, t.keep_last)
        dist.barrier()
        self._last_saved = self.step
        return target

    def _agree_on_save(self, err: OSError | None, target: Path) -> None:
        """Collective: when any rank's part of the save failed, remove the partial ``target`` and stop."""
        import deepspeed.comm as dist

        flag = torch.tensor([0.0 if err is None else 1.0])
        if self.engine.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        if self.engine.rank == 0:
            shutil.rmtree(target, ignore_errors=True)  # what is left has no manifest: `auto` skips it
        if err is None:
            raise ReportedElsewhere(EXIT_CHECKPOINT_WRITE)
        raise CheckpointWriteError(
            f"checkpoint of step {self.step} could not be written to {target}: {err}; the partial checkpoint was removed. "
            + self._last_valid_note()
        )

    def _last_valid_note(self) -> str:
        latest = self.ckpt_root / ckpt.LATEST
        try:
            tag = latest.read_text().strip()
            ckpt.verify(self.ckpt_root / tag, hash_files=False)
        except (OSError, ckpt.CheckpointError):
            return "There is no earlier valid checkpoint: this run cannot be resumed."
        return (
            f"The last valid checkpoint is step {ckpt.step_of(Path(tag))} ({self.ckpt_root / tag}), untouched, and "
            f"{latest} still points to it: free space (or fix the error) and rerun with trainer.resume=auto."
        )

    # ---------------------------------------------------------------------------------- steps
    def train_step(self) -> dict[str, float]:
        p = self.cfg.parallel
        batches = [next(self._train_iter) for _ in range(p.grad_accum)]
        poison = (self.step + 1) in set(self.cfg.trainer.debug_nan_steps)  # TEST HOOK
        r = self.engine.train_step(batches, poison=poison)
        self.step += 1
        tokens = sum(b.input_ids_BT.numel() for b in batches) * self.engine.dp_world
        out = {"train/total_loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens": tokens}
        if r.ce is not None:
            out["train/loss"] = r.ce
        if r.moe_load_ratio is not None:
            out["moe/load_max_over_mean"] = r.moe_load_ratio
        if r.comm_bytes is not None:
            out["comm/bytes_per_step"] = r.comm_bytes
        if r.skipped:
            self.skipped_total += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0
        out["train/skipped_steps"] = self.skipped_total
        return out

    def evaluate(self) -> float | None:
        """Mean next-token loss over the first ``eval_batches`` validation batches (None: no split,
        or a rank that does not own the loss)."""
        if self.data.val is None:
            return None
        return self.engine.eval_loss(list(self.data.val.batches(self.cfg.trainer.eval_batches)))

    # ---------------------------------------------------------------------------- monitoring
    def _diag_batches(self) -> list:
        src = self.data.val if self.data.val is not None else self.data.train
        return [src.batch_at(0, 0)]

    def _pipe_gather(self, obj) -> list:
        """``obj`` of every stage of this data-parallel fiber (a pipeline); ``[obj]`` otherwise."""
        import deepspeed.comm as dist

        e = self.engine
        if not e.pipelined:
            return [obj]
        out = [None] * e.engine.grid.get_pipe_parallel_world_size()
        dist.all_gather_object(out, obj, group=e.engine.grid.get_pipe_parallel_group())
        return out

    def moe_metrics(self) -> dict[str, float]:
        """Collective under pipeline parallelism (every stage holds some MoE layers)."""
        from msar_train.train.monitor import moe_metrics

        return _merge_moe(self._pipe_gather(moe_metrics(self.engine.engine.module)))

    def residual_metrics(self) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """Collective: one recorded no-grad forward over a fixed held-out batch on every rank (expert
        and pipeline parallel forwards need them all); a pipeline's stages record their own sites and
        the records are gathered to every stage. Meaningful on the loss owner."""
        from msar_train.residual.diagnostics import record_diagnostics
        from msar_train.train.monitor import collect_residual_metrics, residual_metrics

        e = self.engine
        batches = self._diag_batches()
        if not e.pipelined:
            return collect_residual_metrics(e.engine.module, batches)
        e.loss_fn.pop_mean()
        with record_diagnostics(e.engine.module) as rec:
            e.engine.eval_batch(data_iter=e._pipe_iter(batches), num_micro_batches=len(batches))
        e.engine.train()
        e.loss_fn.pop_mean()
        return residual_metrics([r for part in self._pipe_gather(rec.records) for r in part])

    def _estimate_flops_per_token(self) -> float | None:
        """6 * active params + attention (PaLM's 12 * L * H * Q * T), training FLOPs per token; GPU only."""
        if not torch.cuda.is_available():
            return None
        from msar_train.train.params import count_params

        m = self.cfg.model
        head_dim = m.head_dim or m.d_model // m.n_heads
        return 6.0 * count_params(self.cfg)["active_params"] + 12.0 * m.n_layers * m.n_heads * head_dim * self.cfg.data.seq_len

    def _mfu(self, tokens_per_s: float) -> float | None:
        if self._flops_per_token is None:
            return None
        peak = self.cfg.logger.peak_tflops
        if peak is None:
            name = torch.cuda.get_device_name()
            peak = next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
            if peak is None:
                return None
        return tokens_per_s * self._flops_per_token / (peak * 1e12 * self.engine.world)

    # ------------------------------------------------------------------------------- signals
    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:  # a second signal: stop now, without a checkpoint
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self._stop_signal = signum
        print(f"msar-train: {signal.Signals(signum).name}: finishing step {self.step + 1}, then saving and exiting", flush=True)

    def _stop_requested(self) -> bool:
        """Collective when several ranks run: any rank's signal stops all at the same step."""
        import deepspeed.comm as dist

        flag = torch.tensor([0.0 if self._stop_signal is None else float(self._stop_signal)], device=self.engine.device)
        if self.engine.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self._stop_signal is None:
            self._stop_signal = int(flag.item())
        return bool(flag.item())

    # ----------------------------------------------------------------------------------- fit
    def fit(self) -> FitResult:
        t, lg = self.cfg.trainer, self.cfg.logger
        self.harness = None
        if t.eval_harness.tasks:  # validated: single stage, no expert parallelism, lm-eval installed
            from msar_train.export.harness import HarnessRunner

            self.harness = HarnessRunner(self.cfg, self.engine.engine.module)
        owner = self.engine.owns_loss
        train_loss, val_loss = None, None
        window: list[float] = []
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            with Progress(t.max_steps, enabled=t.progress and owner, start=self.step) as bar:
                end = t.max_steps if t.stop_at is None else t.stop_at  # stop_at: end this job early
                while self.step < end:
                    t0 = time.perf_counter()
                    m = self.train_step()
                    dt = time.perf_counter() - t0
                    m["tokens_per_s"] = m.pop("tokens") / dt
                    m["step_time_s"] = dt
                    mfu = self._mfu(m["tokens_per_s"])
                    if mfu is not None:
                        m["mfu"] = mfu
                    if "train/loss" in m and math.isfinite(m["train/loss"]):
                        window.append(m["train/loss"])
                    step, last = self.step, self.step == t.max_steps
                    log_now = step % t.log_every == 0 or last
                    if step % t.eval_every == 0 or last:
                        v = self.evaluate()
                        if v is not None:
                            val_loss = m["val/loss"] = v
                            log_now = True  # an evaluation is always logged, whatever log_every says
                        if self.harness is not None:  # trainer.eval_harness: every rank alike, no collective
                            m.update(self.harness())
                            log_now = True
                    heatmaps = {}
                    want_heat = lg.heatmap_every > 0 and (step % lg.heatmap_every == 0 or last)
                    if want_heat or (lg.residual_every > 0 and (step % lg.residual_every == 0 or last)):
                        scalars, heatmaps = self.residual_metrics()
                        m.update(scalars)
                        log_now = True
                    if log_now:
                        m.update(self.moe_metrics())
                        m.update(self.data.train.metrics())  # data/tokens/<name> of a mixture
                        if window:
                            train_loss = m["train/loss_avg"] = float(np.mean(window))
                            window = []
                        if self.metrics is not None:
                            self.metrics.log(step, m, images=self._heatmap_images(step, heatmaps) if want_heat else None)
                    if owner:
                        bar.update(step, m)
                    if self.consecutive_skips >= t.max_consecutive_skips:
                        raise TrainingHalted(
                            f"trainer.max_consecutive_skips={t.max_consecutive_skips}: steps {step - self.consecutive_skips + 1}..{step} "
                            f"all had a non-finite loss or gradient norm and were skipped; stopping. "
                            f"Resume from the last checkpoint in {self.ckpt_root} with a lower trainer.lr or other data."
                        )
                    stop = self._stop_requested()
                    stop_at = step == end
                    if stop or stop_at or last or (t.save_every > 0 and step % t.save_every == 0):
                        self.save_checkpoint()
                    if stop or stop_at:
                        break
                    self.lock.touch()  # the run dir's heartbeat (rundir.py)
            if self.step == t.max_steps and self._last_saved != self.step:  # resumed at max_steps: nothing ran
                self.save_checkpoint()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.close()
        name = signal.Signals(self._stop_signal).name if self._stop_signal else None
        return FitResult(self.run_dir, self.step, train_loss, val_loss, owner, stopped_by_signal=name, resumed_from=self.resumed_from)

    def _heatmap_images(self, step: int, heatmaps: dict[str, np.ndarray]) -> dict[str, Path]:
        """Write the depth-attention heatmap of this step to ``RUN_DIR/plots/`` ({} for backends without one)."""
        from msar_train.train.monitor import DEPTH_HEATMAP, depth_attention_png

        if DEPTH_HEATMAP not in heatmaps:
            return {}
        png = self.run_dir / "plots" / "depth_attention" / f"step{step:08d}.png"
        return {DEPTH_HEATMAP: depth_attention_png(heatmaps[DEPTH_HEATMAP], png, f"depth attention, step {step}")}
