"""The training engine: every run, one rank included, goes through ``deepspeed.initialize``.

``pp_stages == 1``: a ``DeepSpeedEngine`` around the plain ``Transformer`` (ZeRO 0/1/2, data and
expert parallelism). ``pp_stages > 1``: a ``PipelineEngine`` around ``MSARPipelineModule`` built from
the same layer recipe. Both expose the same small surface to the trainer: ``train_step``,
``eval_loss``, ``save`` / ``load`` and the rank facts needed for logging.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import math
import os
import socket
import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from msar_train.config.validate import validate_world
from msar_train.parallel.ds_config import build_ds_config, resolve_dtype


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment() -> None:
    """Defaults that let a bare ``msar-train`` (no launcher) and CPU machines work."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # no launcher: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))


def init_distributed(p: DictConfig) -> None:
    prepare_environment()
    # DeepSpeed JIT-builds a shared-memory op on every init (~50 s cold on CPU) that only serves
    # inference all-reduce; training never uses it.
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import deepspeed

    backend = p.dist_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=p.dist_timeout_s))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def shutdown_distributed() -> None:
    """End a run's process groups on every rank together: a barrier, then ``destroy_process_group``.

    Left to the interpreter's exit, gloo's worker threads are torn down by static destructors in no
    fixed order, and now and then one rank aborts with ``terminate called without an active
    exception`` (SIGABRT, exit -6) after training has finished and its checkpoint is written: the
    launcher then reports the whole run failed. Call only after a run that ended normally on every
    rank (a barrier with a rank gone would wait for the timeout). A single process keeps its group:
    DeepSpeed caches groups of it (expert and data-parallel groups) that a later run in the same
    process (tests, a sweep) reuses, and a lone gloo group has no peer thread to abort on."""
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_initialized() or tdist.get_world_size() < 2:
        return
    tdist.barrier()
    tdist.destroy_process_group()


@dataclass
class StepResult:
    loss: float  # CE + aux, mean over the step's micro-batches and data-parallel ranks
    ce: float | None  # CE alone (on the rank that owns the loss; None elsewhere)
    grad_norm: float
    lr: float
    moe_load_ratio: float | None  # mean over MoE layers of max/mean expert load (global)
    skipped: bool = False  # non-finite loss or gradient norm: no parameter, optimizer or schedule update
    comm_bytes: int | None = None  # pipeline point-to-point bytes of the step (interleaved engine only)


def _guarded_loss(base):
    """The pipeline/plain loss with the two hooks the step guard needs: ``poison`` (TEST HOOK,
    ``trainer.debug_nan_steps``: the loss becomes NaN, so every gradient does) and a sticky
    ``nonfinite`` flag raised when any micro-batch loss is not finite."""

    class GuardedLoss(base):
        poison = False
        nonfinite = False

        def __call__(self, outputs, labels_BT):
            total = super().__call__(outputs, labels_BT)
            if self.poison:
                total = total * float("nan")
                self.ce[-1] = self.ce[-1] * float("nan")
            if not bool(torch.isfinite(total.detach())):
                self.nonfinite = True
            return total

        def take_nonfinite(self) -> bool:
            out, self.nonfinite = self.nonfinite, False
            return out

    return GuardedLoss()


class Engine:
    def __init__(self, cfg: DictConfig):
        import deepspeed
        import deepspeed.comm as dist

        from msar_train.model.transformer import Transformer
        from msar_train.parallel.optim import build_scheduler, param_groups
        from msar_train.parallel.pipeline import LossFn, MSARPipelineModule
        from msar_train.residual import build_backend

        self.cfg = cfg
        p = cfg.parallel
        init_distributed(p)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        validate_world(p, self.world)
        self.pipelined = p.pp_stages > 1
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = resolve_dtype(p, device_type)
        self.loss_fn = _guarded_loss(LossFn)
        torch.manual_seed(cfg.trainer.seed)
        expert_groups = None
        self.ep_rank = 0  # which slice of the routed experts this rank holds (train/reshard.py)
        if p.ep_size > 1:
            from msar_train.parallel.expert import expert_groups_from_deepspeed

            expert_groups = expert_groups_from_deepspeed(p.ep_size, p.pp_stages)  # collective, before any model
            self.ep_rank = expert_groups.ep_rank
        if self.pipelined:
            m = cfg.model
            backend = build_backend(cfg.residual, m.n_layers, m.d_model, m.norm_eps, m.init_std)
            if p.virtual_stages > 1:
                from msar_train.parallel.interleaved import InterleavedPipelineModule

                model = InterleavedPipelineModule(cfg, backend, self.loss_fn)
            else:
                model = MSARPipelineModule(cfg, backend, self.loss_fn)
            layers = model.all_layers() if p.virtual_stages > 1 else model.forward_funcs
            self.moe_layers = [f.ffn for f in layers if getattr(f, "is_moe", False)]
        else:
            model = Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=cfg.trainer.seed)
            model.activation_checkpointing = p.activation_checkpointing
            self.moe_layers = model.moe_layers()
        if expert_groups is not None:
            from msar_train.parallel.expert import shard_model_experts

            shard_model_experts(model, expert_groups.ep_group, expert_groups.ep_rank, expert_groups.ep_size)
        groups = param_groups(model, cfg.trainer.weight_decay)
        if p.ep_size > 1:
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            for i, g in enumerate(groups):
                g["name"] = f"group{i}"
            groups = split_params_into_different_moe_groups_for_optimizer(groups)
        t = cfg.trainer
        opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        sched = build_scheduler(opt, t)
        ds_config = build_ds_config(cfg, self.world, device_type)
        self.ds_config = ds_config
        if self.pipelined and p.virtual_stages > 1:
            from msar_train.parallel.interleaved import initialize_interleaved

            init = functools.partial(initialize_interleaved, summary_cache=p.summary_cache)
        else:
            init = deepspeed.initialize
        self.engine, self.optimizer, _, self.scheduler = init(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config)
        self.device = self.engine.device
        self._record_grad_norm(expert_groups.ep_group if expert_groups is not None else None)
        self._install_step_guard()
        if self.pipelined:
            self.stage = self.engine.stage_id
            self.dp_rank = self.engine.grid.data_parallel_id
            self.dp_world = self.engine.grid.data_parallel_size
            self.dp_group = self.engine.grid.get_data_parallel_group()
            self.owns_loss = self.engine.is_last_stage() and self.dp_rank == 0
        else:
            from deepspeed.utils import groups as ds_groups

            self.stage = 0
            self.dp_group = ds_groups._get_data_parallel_group()
            self.dp_rank = dist.get_rank(group=self.dp_group)
            self.dp_world = dist.get_world_size(group=self.dp_group)
            self.owns_loss = self.dp_rank == 0

    def _record_grad_norm(self, expert_group) -> None:
        """fp32 without ZeRO: DeepSpeed clips but drops the norm, and its ``clip_grad_norm_`` neither
        skips pipeline-replicated parameters nor sums expert shards. Replace it with the global norm
        of the one logical model: each parameter counted once (replicas of shared residual modules
        skipped), expert shards summed over the expert-parallel group, stages summed over the pipe."""
        import deepspeed.comm as dist
        from deepspeed.moe.utils import is_moe_param

        eng = self.engine
        pipe_group = eng.grid.get_pipe_parallel_group() if self.pipelined else None

        def clip_and_record(skip_clip: bool = False):
            dense = torch.zeros((), dtype=torch.float64, device=self.device)
            expert = torch.zeros((), dtype=torch.float64, device=self.device)
            grads = []
            for p in eng.module.parameters():
                if p.grad is None:
                    continue
                grads.append(p.grad)
                if getattr(p, "ds_pipe_replicated", False):
                    continue
                sq = p.grad.detach().double().square().sum()
                if is_moe_param(p):
                    expert += sq
                else:
                    dense += sq
            if expert_group is not None:
                dist.all_reduce(expert, group=expert_group)
            total = dense + expert
            if pipe_group is not None:
                dist.all_reduce(total, group=pipe_group)
            norm = total.sqrt()
            max_norm = eng.gradient_clipping()
            coef = max_norm / (float(norm) + 1e-6)
            if max_norm > 0 and not skip_clip and math.isfinite(float(norm)) and coef < 1.0:
                for g in grads:
                    g.mul_(coef)
            eng._global_grad_norm = float(norm)

        eng.clip_fp32_gradients = clip_and_record
        self._clip_and_record = clip_and_record

    def _install_step_guard(self) -> None:
        """Skip the optimizer step when a micro-batch loss or the global gradient norm is not finite.

        Wraps the instance's ``_take_model_step`` (what ``DeepSpeedEngine.step`` and the pipe
        engine's ``_exec_optimizer_step`` both call at the accumulation boundary). Without ZeRO / fp16 /
        bf16 the norm is ours (``_record_grad_norm``): it is computed before the step, and a
        non-finite norm or loss drops every gradient and sets ``optimizer.overflow``, which sends
        DeepSpeed down its own overflow path (no parameter or optimizer-state update, LR schedule
        held, ``skipped_steps`` += 1). With ZeRO / bf16 / fp16 DeepSpeed's optimizer detects a
        non-finite norm itself and takes the same path. The loss flag is all-reduced over the world:
        a loss is known only on its data-parallel rank / the last stage, the decision must be common."""
        import deepspeed.comm as dist

        eng = self.engine
        orig = eng._take_model_step
        own_norm = not (eng.fp16_enabled() or eng.bfloat16_enabled() or eng.zero_optimization())

        def take_model_step(lr_kwargs=None):
            bad = torch.tensor([1.0 if self.loss_fn.take_nonfinite() else 0.0], device=self.device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if own_norm:
                self._clip_and_record(skip_clip=bool(bad.item()))
                finite = not bad.item() and math.isfinite(eng._global_grad_norm)
                if not finite:
                    for p in eng.module.parameters():
                        p.grad = None
                eng.optimizer.overflow = not finite
            orig(lr_kwargs)

        eng._take_model_step = take_model_step
        if own_norm:
            eng.clip_fp32_gradients = lambda: None  # clipped above, before the finiteness decision

    # ----------------------------------------------------------------------------------- steps
    def _inputs(self, batch):
        ids = batch.input_ids_BT.to(self.device)
        if not self.cfg.data.document_mask:
            return ids
        return (ids, batch.doc_ids_BT.to(self.device), batch.positions_BT.to(self.device))

    def _pipe_iter(self, batches):
        for b in batches:
            yield self._inputs(b), b.labels_BT.to(self.device)

    def _forward_loss(self, batch) -> torch.Tensor:
        x = self._inputs(batch)
        out = self.engine(x) if not isinstance(x, tuple) else self.engine(*x)
        return self.loss_fn(out, batch.labels_BT.to(self.device))

    def train_step(self, batches: list, poison: bool = False) -> StepResult:
        """One optimizer step over ``grad_accum`` micro-batches (``batches``). ``poison``: TEST HOOK,
        the step's loss becomes NaN (``trainer.debug_nan_steps``); the step guard then skips it."""
        import deepspeed.comm as dist

        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step applies
        self.loss_fn.poison = poison
        self.loss_fn.nonfinite = False  # an evaluation since the last step must not decide this one
        if self.pipelined:
            loss = float(self.engine.train_batch(data_iter=self._pipe_iter(batches)))
        else:
            self.engine.train()
            losses = []
            for b in batches:
                lo = self._forward_loss(b)
                self.engine.backward(lo)
                self.engine.step()
                losses.append(lo.detach())
            loss_t = torch.stack(losses).mean()
            if self.dp_world > 1:
                dist.all_reduce(loss_t, group=self.dp_group)
                loss_t /= self.dp_world
            loss = float(loss_t)
        ce = self.loss_fn.pop_mean()
        if ce is not None and self.dp_world > 1:
            t = torch.tensor(ce, dtype=torch.float64)
            dist.all_reduce(t, group=self.dp_group)
            ce = float(t) / self.dp_world
        self.loss_fn.poison = False
        gn = self.engine.get_global_grad_norm()
        skipped = not self.engine.was_step_applied()
        return StepResult(
            loss=loss,
            ce=ce,
            grad_norm=float(gn) if gn is not None else float("nan"),
            lr=lr,
            moe_load_ratio=self._update_router_biases(apply=not skipped),
            skipped=skipped,
            comm_bytes=getattr(self.engine, "comm_bytes_last_step", None),
        )

    # ----------------------------------------------------------------------------- checkpoints
    def save(self, save_dir, tag: str, client_state: dict) -> None:
        """Collective: every rank writes its DeepSpeed files (model or pipeline layer files, expert
        files, optimizer / ZeRO shards) under ``save_dir/tag``. DeepSpeed's own ``latest`` file is not
        written: ``train/checkpoint.py`` writes the pointer after the checkpoint is verified."""
        self.engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False)

    def load(self, load_dir, tag: str) -> dict:
        """Collective: restore module (router-bias buffers included), optimizer and LR schedule from
        ``load_dir/tag``; returns the client state saved with it."""
        path, client_state = self.engine.load_checkpoint(str(load_dir), tag=tag)
        if path is None:
            raise FileNotFoundError(f"{load_dir}/{tag}: DeepSpeed found no checkpoint to load")
        return client_state or {}

    def _update_router_biases(self, apply: bool = True) -> float | None:
        """Aux-loss-free balancing after each optimizer step, from the loads summed over the
        data-parallel group so every replica applies the identical update."""
        import deepspeed.comm as dist

        ratios = []
        for moe in self.moe_layers:
            counts = moe.consume_load().to(self.device)
            if self.dp_world > 1:
                dist.all_reduce(counts, group=self.dp_group)
            if counts.sum() > 0:
                ratios.append(float(counts.max() / counts.mean()))
            if apply:  # a skipped step updates nothing, the selection biases included
                moe.apply_bias_update(counts)
        acc = torch.tensor([sum(ratios), len(ratios)], dtype=torch.float64, device=self.device)
        if self.pipelined:  # every stage's MoE layers, not only the loss owner's
            dist.all_reduce(acc, group=self.engine.grid.get_pipe_parallel_group())
        return float(acc[0] / acc[1]) if acc[1] > 0 else None

    @torch.no_grad()
    def eval_loss(self, batches: list) -> float | None:
        """Mean CE over ``batches`` (known on the rank that owns the loss; None elsewhere)."""
        import deepspeed.comm as dist

        self.loss_fn.pop_mean()
        if self.pipelined:
            self.engine.eval_batch(data_iter=self._pipe_iter(batches), num_micro_batches=len(batches))
            self.engine.train()
        else:
            self.engine.eval()
            for b in batches:
                self._forward_loss(b)
            self.engine.train()
        ce = self.loss_fn.pop_mean()
        if ce is not None and self.dp_world > 1:
            t = torch.tensor(ce, dtype=torch.float64)
            dist.all_reduce(t, group=self.dp_group)
            ce = float(t) / self.dp_world
        return ce
