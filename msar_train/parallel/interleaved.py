"""Interleaved virtual pipeline stages on DeepSpeed's pipe engine, with the cross-stage summary cache.

``parallel.virtual_stages = V > 1``: ``Transformer.layers()`` is cut into ``C = P V`` chunks (same cut
rules as plain pipelining, ``parallel/partition.py``); chunk ``c`` lives on pipeline rank ``c mod P``, so
every rank hosts V non-contiguous chunks. Built the way DeepSpeed's own multi-chunk design (DualPipeV)
is: ``InterleavedPipelineModule(MSARPipelineModule)`` builds the V chunks and exposes one at a time
(``activate_chunk``); ``InterleavedPipelineEngine(PipelineEngine)`` runs ``InterleavedSchedule``
(Megatron's interleaved 1F1B, ``interleaved_schedule.py``) through DeepSpeed's ``_exec_schedule`` with a
``chunk`` on every instruction, reusing the parent's forward/backward passes (GAS scaling, hooks, bf16),
gradient reduction, ZeRO-1 step, loss aggregation and checkpointing. Layer checkpoint files are named by
global layer index, so a checkpoint does not depend on V.

Wire format and cache (``comm.py``): a hop sends the carry minus the completed summaries the receiving
rank already holds for that micro-batch. After chunk ``c``'s forward the rank stores *detached* leaves of
the completed summaries of its output (entry ``(m, c)``) for its next chunk ``c + P``, which assembles its
input from them plus the received delta. Gradients of cached leaves stay on the rank: chunk ``c``'s
backward adds each leaf's ``.grad`` to the gradient of the matching output (plus any gradient received for
it) and frees the entry, which is its last use. Interleaved 1F1B runs chunk ``c + P``'s backward for a
micro-batch before chunk ``c``'s, so every leaf gradient is complete by then. ``summary_cache: false``
sends every summary on every hop (the naive transport).

Transport: asynchronous sends, blocking receives right before use, tags per (micro-batch, hop,
direction, tensor); every byte sent is counted here (``comm_bytes_last_step``: the pipeline's total over
its ranks for the last training step; ``comm_hop_bytes``: this rank's bytes per hop).

Legend: P pipeline ranks, V chunks per rank, C = P V chunks, M micro-batches per step.
"""

from __future__ import annotations

from contextlib import contextmanager

import deepspeed.comm as dist
import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from msar_train.model.init import init_layer_
from msar_train.parallel.comm import chunk_cut_specs, hop_plan, summary_positions
from msar_train.parallel.interleaved_schedule import InterleavedSchedule, WaitSends
from msar_train.parallel.partition import partition
from msar_train.parallel.pipeline import MSARPipelineModule

_INIT = object()  # the parent engine's __init__ runs before any chunk state exists


class InterleavedPipelineModule(MSARPipelineModule):
    """``MSARPipelineModule`` holding the V chunks ``v P + stage_id``; ``forward`` runs the active one."""

    def __init__(self, cfg, backend, loss_fn, topology=None):
        self._cfg = cfg
        self.virtual_stages = cfg.parallel.virtual_stages
        super().__init__(cfg, backend, loss_fn, topology)
        # The parent initialised the active chunk's layers; the others here. Shared residual modules
        # (re-initialised to the same deterministic values) are re-synchronised afterwards.
        for v in range(1, self.virtual_stages):
            with self.chunk(v):
                for local_idx, layer in enumerate(self.forward_funcs):
                    init_layer_(layer, cfg.trainer.seed, local_idx + self._local_start, cfg.model.init_std)
        self._broadcast_shared()

    # ------------------------------------------------------------------ partition and build
    def _partition_layers(self, method="uniform"):
        P, V = self.num_stages, self.virtual_stages
        c = self._cfg
        try:
            self.parts = partition(c.model, c.residual, P * V, c.parallel.partition_method)
        except ValueError as e:
            raise ValueError(f"parallel.virtual_stages={V}: cannot cut {P * V} chunks: {e}") from e
        self.chunk_ids = [v * P + self.stage_id for v in range(V)]
        self.chunk_bounds = [(self.parts[k], self.parts[k + 1]) for k in self.chunk_ids]
        self._set_bounds(*self.chunk_bounds[0])

    def _build(self):
        self.chunk_funcs = []
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
        self.chunk_checkpointable = [[] for _ in self.chunk_bounds]
        self.activate_chunk(0)

    def activate_chunk(self, v: int) -> None:
        """Expose local chunk ``v`` (global chunk ``v P + stage_id``) as this module's forward."""
        self.active_chunk = v
        self.forward_funcs = self.chunk_funcs[v]
        self.is_checkpointable_results = self.chunk_checkpointable[v]
        self._local_start, self._local_stop = self.chunk_bounds[v]

    @contextmanager
    def chunk(self, v: int):
        before = self.active_chunk
        self.activate_chunk(v)
        try:
            yield
        finally:
            self.activate_chunk(before)

    def all_layers(self) -> list:
        return [f for funcs in self.chunk_funcs for f in funcs]

    def stage_owner(self, layer_idx):
        for k in range(len(self.parts) - 1):
            if self.parts[k] <= layer_idx < self.parts[k + 1]:
                return k % self.num_stages
        raise RuntimeError(f"layer {layer_idx} outside parts={self.parts}")

    def _precompute_checkpointable_values(self):
        for v in range(self.virtual_stages):
            with self.chunk(v):
                self.is_checkpointable_results_interval = None  # the parent caches per interval
                super()._precompute_checkpointable_values()
                self.chunk_checkpointable[v] = self.is_checkpointable_results

    # ------------------------------------------------------------------ per-chunk delegation
    def save_state_dict(self, *args, **kwargs):
        for v in range(self.virtual_stages):
            with self.chunk(v):
                super().save_state_dict(*args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        for v in range(self.virtual_stages):
            with self.chunk(v):
                super().load_state_dir(*args, **kwargs)

    def compile(self, *args, **kwargs):
        for v in range(self.virtual_stages):
            with self.chunk(v):
                super().compile(*args, **kwargs)


class InterleavedPipelineEngine(PipelineEngine):
    """``PipelineEngine`` running ``InterleavedSchedule`` over an ``InterleavedPipelineModule``."""

    def __init__(self, *args, summary_cache: bool = True, **kwargs):
        self._active_chunk = _INIT
        super().__init__(*args, **kwargs)
        assert isinstance(self.module, InterleavedPipelineModule), "model must be an InterleavedPipelineModule"
        assert not (self.is_pipe_partitioned or self.is_grad_partitioned), "pipe/grad partitioning is not supported"
        assert not self.dynamic_shape, "the interleaved engine plans every hop's shapes statically"
        self._active_chunk = None
        self.virtual_stages = self.module.virtual_stages
        self.num_chunks = self.num_stages * self.virtual_stages
        self.summary_cache = summary_cache
        cfg = self.module._cfg
        # Activations travel in the parameters' dtype (DeepSpeed has cast the module for bf16 by now).
        dtype = next(p.dtype for p in self.module.parameters() if p.is_floating_point())
        cut_specs = chunk_cut_specs(
            self.module.backend, self.module.parts, self.micro_batch_size, cfg.data.seq_len, dtype, cfg.data.document_mask
        )
        self.hops = hop_plan(cut_specs, self.num_stages, cache=summary_cache)
        # Per slot: loss (loss chunk), received output gradients {carry position: grad}, and the output
        # positions whose detached copies went into the cache.
        for key in ("losses", "grads", "cache_out"):
            self.pipe_buffers[key] = [None] * self.num_pipe_buffers
        self.cache: dict[tuple[int, int], list[torch.Tensor]] = {}  # (micro-batch, chunk) -> leaves
        self.cache_peak_entries = 0
        self._pending_sends: list = []
        self.comm_bytes_step = 0
        self.comm_hop_bytes: dict[int, int] = {}
        self.comm_bytes_last_step: int | None = None

    # ------------------------------------------------------------------ chunk context
    def is_last_stage(self):
        """The loss chunk, while a chunk runs; the rank that hosts it otherwise."""
        if self._active_chunk is _INIT or self._active_chunk is None:
            return super().is_last_stage()
        return self._active_chunk == self.num_chunks - 1

    @contextmanager
    def _chunk(self, chunk: int):
        self._active_chunk = chunk
        self.module.activate_chunk(chunk // self.num_stages)
        try:
            yield
        finally:
            self._active_chunk = None

    def _rank_of(self, chunk: int) -> int:
        return self.grid.stage_to_global(stage_id=chunk % self.num_stages)

    def _tag(self, micro_batch: int, hop: int, backward: bool, pos: int) -> int:
        return ((micro_batch * self.num_chunks + hop) * 2 + int(backward)) * 1024 + pos

    # ------------------------------------------------------------------ schedules
    def _train_schedule(self):
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.virtual_stages, train=True)

    def _inference_schedule(self, micro_batches):
        return InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.virtual_stages, train=False)

    def train_batch(self, data_iter=None):
        self.comm_bytes_step = 0
        self.comm_hop_bytes = {}
        loss = super().train_batch(data_iter)
        assert not self.cache, f"cross-stage cache not empty after the step: {sorted(self.cache)}"
        total = torch.tensor([self.comm_bytes_step], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.grid.get_pipe_parallel_group())
        self.comm_bytes_last_step = int(total)
        return loss

    def eval_batch(self, data_iter, *args, **kwargs):
        out = super().eval_batch(data_iter, *args, **kwargs)
        assert not self.cache, f"cross-stage cache not empty after evaluation: {sorted(self.cache)}"
        return out

    def reset_activation_shape(self):
        raise NotImplementedError("the interleaved engine plans hop shapes from the config; rebuild it to change them")

    # ------------------------------------------------------------------ point-to-point layer
    def _send(self, t: torch.Tensor, chunk: int, tag: int, hop: int) -> None:
        t = t.detach().contiguous()
        self._pending_sends.append((dist.isend(t, self._rank_of(chunk), tag=tag), t))
        n = t.numel() * t.element_size()
        self.comm_bytes_step += n
        self.comm_hop_bytes[hop] = self.comm_hop_bytes.get(hop, 0) + n

    def _recv(self, spec, chunk: int, tag: int) -> torch.Tensor:
        t = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        dist.recv(t, self._rank_of(chunk), tag=tag)
        return t

    def _exec_wait_sends(self):
        for handle, _ in self._pending_sends:
            handle.wait()
        self._pending_sends = []

    # ------------------------------------------------------------------ instructions
    def _exec_recv_activations(self, buffer_id, chunk, micro_batch):
        hop = self.hops[chunk]
        carry: list = [None] * len(hop.specs)
        if hop.cached:
            key = (micro_batch, chunk - self.num_stages)
            leaves = self.cache[key] if torch.is_grad_enabled() else self.cache.pop(key)
            for pos, leaf in zip(hop.cached, leaves):
                carry[pos] = leaf
        for pos in hop.send:
            spec = hop.specs[pos]
            t = self._recv(spec, chunk - 1, self._tag(micro_batch, chunk, False, pos))
            carry[pos] = t.requires_grad_(spec.floating and torch.is_grad_enabled())
        self.pipe_buffers["inputs"][buffer_id] = tuple(carry)

    def _exec_forward_pass(self, buffer_id, chunk, micro_batch):
        with self._chunk(chunk):
            super()._exec_forward_pass(buffer_id)
        grad = torch.is_grad_enabled()
        if chunk == self.num_chunks - 1:
            if grad:
                self.pipe_buffers["losses"][buffer_id] = self.loss
            else:
                self.pipe_buffers["labels"][buffer_id] = None
            self.pipe_buffers["outputs"][buffer_id] = None
            if not grad:
                self.pipe_buffers["inputs"][buffer_id] = None
            return
        outputs = self.pipe_buffers["outputs"][buffer_id]
        specs = self.hops[chunk + 1].specs
        assert len(outputs) == len(specs) and all(tuple(o.shape) == s.shape for o, s in zip(outputs, specs)), (
            f"chunk {chunk} output does not match the planned carry {[s.shape for s in specs]}"
        )
        if self.summary_cache and chunk + self.num_stages < self.num_chunks:
            positions = summary_positions(specs)
            # Detach is load-bearing: the next chunk's graph must not reach into this one, whose
            # backward later receives the leaves' gradients explicitly.
            self.cache[(micro_batch, chunk)] = [outputs[i].detach().requires_grad_(grad) for i in positions]
            self.cache_peak_entries = max(self.cache_peak_entries, len(self.cache))
            self.pipe_buffers["cache_out"][buffer_id] = positions
        if not grad:
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_send_activations(self, buffer_id, chunk, micro_batch):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        hop = self.hops[chunk + 1]
        for pos in hop.send:
            self._send(outputs[pos], chunk + 1, self._tag(micro_batch, chunk + 1, False, pos), chunk + 1)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None
            self.pipe_buffers["cache_out"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, chunk, micro_batch):
        hop = self.hops[chunk + 1]
        self.pipe_buffers["grads"][buffer_id] = {
            pos: self._recv(hop.specs[pos], chunk + 1, self._tag(micro_batch, chunk + 1, True, pos))
            for pos in hop.send
            if hop.specs[pos].floating
        }

    def _exec_backward_pass(self, buffer_id, chunk, micro_batch):
        if chunk == self.num_chunks - 1:
            self.loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
        else:
            outputs = self.pipe_buffers["outputs"][buffer_id]
            grads = self.pipe_buffers["grads"][buffer_id]
            positions = self.pipe_buffers["cache_out"][buffer_id]
            if positions:  # last use of this chunk's cache entry: fold the leaves' gradients in, free it
                for pos, leaf in zip(positions, self.cache.pop((micro_batch, chunk))):
                    if leaf.grad is not None:
                        grads[pos] = grads[pos] + leaf.grad if pos in grads else leaf.grad
            order = sorted(grads)
            self.pipe_buffers["outputs"][buffer_id] = tuple(outputs[i] for i in order)
            self.grad_layer = [grads[i] for i in order]
        with self._chunk(chunk):
            super()._exec_backward_pass(buffer_id)
        self.grad_layer = None
        for key in ("outputs", "grads", "cache_out", "labels"):
            self.pipe_buffers[key][buffer_id] = None
        if chunk == 0:  # the first chunk sends no gradients, so nothing else frees its inputs
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_send_grads(self, buffer_id, chunk, micro_batch):
        carry = self.pipe_buffers["inputs"][buffer_id]
        hop = self.hops[chunk]
        for pos in hop.send:
            if not hop.specs[pos].floating:
                continue
            g = carry[pos].grad
            if g is None:  # a received tensor nothing downstream read: its gradient is zero
                g = torch.zeros_like(carry[pos])
            self._send(g, chunk - 1, self._tag(micro_batch, chunk, True, pos), chunk)
        self.pipe_buffers["inputs"][buffer_id] = None

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.RecvGrad: _exec_recv_grads,
        WaitSends: _exec_wait_sends,
    }


def initialize_interleaved(model, optimizer, lr_scheduler, config: dict, summary_cache: bool):
    """``deepspeed.initialize``'s pipeline branch with our engine class (it only knows its own two)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.zero.partition_parameters.shutdown_init_context()
    mpu = model.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = InterleavedPipelineEngine(
        args=None,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        config=config,
        config_class=config_class,
        summary_cache=summary_cache,
    )
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
