"""Peak memory per pipeline rank, estimated from the model's tensors (``msar-plan``'s ``memory``).

peak = params + optimizer + buckets + max(grads + activations, step)
    params     dtype bytes of the rank's dense parameters plus its routed experts / ``ep_size``.
    grads      the same (gradients live across the step's micro-batches); ZeRO-2 partitions them over DP.
    optimizer  AdamW's two fp32 moments, plus an fp32 master copy whenever DeepSpeed keeps one (ZeRO >= 1
               always clones the partition to fp32; bf16 without ZeRO uses ``BF16_Optimizer``, which does
               the same unpartitioned). Partitioned over the data-parallel group for ZeRO >= 1: dense
               parameters over ``dp``, expert parameters over the expert-data-parallel group
               ``dp / ep_size`` (DeepSpeed's MoE parameter groups).
    activations what the autograd graph keeps of every micro-batch in flight (``retained``, by layer:
               ``activations.py``), times the schedule's in-flight micro-batches (1F1B on stage s of P:
               ``min(P - s, M)``; interleaved: the exact maximum of the outstanding (micro-batch, chunk)
               forwards of ``interleaved_schedule.train_order``), plus the worst transient of one layer
               (its backward workspace, under checkpointing also its recomputed activations, at the head
               the loss's [N, vocab] tensors).
    step       the optimizer step, when a master copy exists: DeepSpeed has freed the model gradients and
               holds the fp32 gradient of the master partition, and ``torch.optim.AdamW`` (single-tensor
               path) makes two temporaries the size of the largest flat group partition. Without one
               the gradients stay during the step.
    buckets    ZeRO >= 1: DeepSpeed's gradient-reduction buffers, ``reduce_bucket_size`` elements each
               (default 5e8, ``parallel.deepspeed_overrides.zero_optimization``) of the gradient dtype,
               allocated whole whatever the model size: one (``setup_buckets``), one more under pipeline
               parallelism (``reduce_gradients(pipeline_parallel=True)``), doubled with ``overlap_comm``.
               Counted with the static parts: 2 x 5e8 x 2 B = 1.9 GiB per bf16 pipeline rank.
With ``parallel.activation_checkpointing`` a checkpointed layer keeps only its input (the carry); the
pipeline engine checkpoints every layer with parameters (embedding and head too), the single-process
model its blocks.

Legend: P pipeline ranks, V chunks per rank, M micro-batches per step (``grad_accum``), s stage, dp
data-parallel size per stage, ep expert-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msar_train.model.transformer import layer_specs
from msar_train.parallel.activations import LayerActivations, layer_activations

GIB = 1024**3


@dataclass(frozen=True)
class ParamSplit:
    """Parameters held by one pipeline rank before expert sharding."""

    dense: int
    expert: int  # routed-expert parameters of the rank's MoE layers (all experts, before / ep_size)


def stage_param_splits(cfg, backend, ranges: list[list[tuple[int, int]]]) -> list[ParamSplit]:
    """Dense / routed-expert parameters per pipeline rank, on the meta device (a module shared by
    several layers of one rank counted once)."""
    specs = layer_specs(cfg.model, backend, cfg.data.document_mask)
    with torch.device("meta"):
        layers = [cls(*args) for cls, args in specs]
    out = []
    for chunks in ranges:
        dense: dict[int, int] = {}
        expert: dict[int, int] = {}
        for start, stop in chunks:
            for layer in layers[start:stop]:
                for name, p in layer.named_parameters():
                    (expert if ".experts." in f".{name}" else dense)[id(p)] = p.numel()
        out.append(ParamSplit(sum(dense.values()), sum(expert.values())))
    return out


def static_bytes(split: ParamSplit, elem: int, zero_stage: int, bf16: bool, dp: int, ep: int) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes of one rank (ZeRO stage 0/1/2, AdamW)."""
    expert_local = split.expert // ep
    n_local = split.dense + expert_local
    zdp, zedp = (dp, dp // ep) if zero_stage >= 1 else (1, 1)
    opt_dense, opt_expert = split.dense / zdp, expert_local / zedp  # elements whose fp32 state this rank holds
    master = zero_stage >= 1 or bf16
    per_elem = 8 + (4 if master else 0)  # moments (+ fp32 master)
    grads = elem * (opt_dense + opt_expert) if zero_stage >= 2 else elem * n_local
    # the step: fp32 gradient partition + AdamW's two temporaries of the largest flat group partition
    # (experts get groups of their own only under expert parallelism: parallel/engine.py)
    largest = max(opt_dense, opt_expert) if ep > 1 else opt_dense + opt_expert
    step = 4 * (opt_dense + opt_expert) + 2 * 4 * largest if master else grads
    return {
        "params": int(elem * n_local),
        "grads": int(grads),
        "optimizer": int(per_elem * (opt_dense + opt_expert)),
        "step_transient": int(step),
    }


DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size


def bucket_bytes(p, elem: int) -> int:
    """ZeRO's gradient-reduction buffers on one rank (see the module docstring)."""
    if p.zero_stage < 1:
        return 0
    zo = dict(p.deepspeed_overrides.get("zero_optimization", {}) or {}) if p.deepspeed_overrides else {}
    size = int(zo.get("reduce_bucket_size", DS_REDUCE_BUCKET))
    n = (1 + int(p.pp_stages > 1)) * (2 if zo.get("overlap_comm", False) else 1)
    return n * size * elem


def inflight_1f1b(P: int, stage: int, M: int) -> int:
    """DeepSpeed's ``TrainSchedule``: stage s holds the activations of ``min(P - s, M)`` micro-batches."""
    return min(P - stage, M)


def inflight_interleaved(P: int, V: int, M: int, rank: int, chunk_bytes: dict[int, int]) -> tuple[int, int]:
    """(max outstanding forwards, max bytes they hold) along ``train_order`` on ``rank``; a forward
    is outstanding from its ``F`` until its ``B``. ``chunk_bytes[c]``: one micro-batch of chunk c."""
    from msar_train.parallel.interleaved_schedule import train_order

    live: set[tuple[int, int]] = set()
    most, most_bytes, cur = 0, 0, 0
    for kind, m, c in train_order(P, V, M, rank):
        if kind == "F":
            live.add((m, c))
            cur += chunk_bytes[c]
            most, most_bytes = max(most, len(live)), max(most_bytes, cur)
        else:
            live.remove((m, c))
            cur -= chunk_bytes[c]
    return most, most_bytes


def chunk_activation_bytes(acts: list[LayerActivations], checkpointed: list[bool]) -> int:
    """One micro-batch of a chunk: its input carry plus, per layer, all it retains or (checkpointed)
    only its output carry, which the next layer's checkpoint keeps as its input."""
    total = acts[0].input_bytes
    for a, ckpt in zip(acts, checkpointed, strict=True):
        total += (a.output_bytes if ckpt else a.retained) + a.loss_kept
    return total


def chunk_transient_bytes(acts: list[LayerActivations], checkpointed: list[bool]) -> int:
    """The worst single-layer moment: backward workspace, plus the recomputed layer under checkpointing."""
    return max(
        (a.transient if a.transient_ckpt is None else a.transient_ckpt) + a.retained if ckpt else a.transient
        for a, ckpt in zip(acts, checkpointed, strict=True)
    )


def memory_plan(cfg, backend, ranges: list[list[tuple[int, int]]], dtype: torch.dtype, world_size: int) -> list[dict]:
    """Per pipeline rank: the parts of its peak (bytes), the in-flight micro-batches and the total."""
    m, p = cfg.model, cfg.parallel
    P, V, M = p.pp_stages, p.get("virtual_stages", 1), p.grad_accum
    B, T = p.micro_batch_size, cfg.data.seq_len
    dp, ep = world_size // P, p.ep_size
    elem = torch.empty((), dtype=dtype).element_size()
    bf16 = dtype == torch.bfloat16
    acts = layer_activations(cfg, backend, B, T, dtype, pipelined=P > 1)
    ckpt_on = bool(p.activation_checkpointing)
    n = m.n_layers + 2

    def checkpointed(i: int) -> bool:
        if not ckpt_on:
            return False
        return True if P > 1 else 0 < i < n - 1  # the pipeline checkpoints every layer with parameters

    splits = stage_param_splits(cfg, backend, ranges)
    out = []
    for r, chunks in enumerate(ranges):
        static = static_bytes(splits[r], elem, p.zero_stage, bf16, dp, ep)
        per_chunk, transient = {}, 0
        for i, (start, stop) in enumerate(chunks):
            c = i * P + r
            layer_acts, flags = acts[start:stop], [checkpointed(j) for j in range(start, stop)]
            per_chunk[c] = chunk_activation_bytes(layer_acts, flags)
            transient = max(transient, chunk_transient_bytes(layer_acts, flags))
        if V > 1:
            inflight, held = inflight_interleaved(P, V, M, r, per_chunk)
        else:
            inflight = inflight_1f1b(P, r, M)
            held = inflight * per_chunk[r]
        activations = held + transient
        buckets = bucket_bytes(p, elem)
        total = static["params"] + static["optimizer"] + buckets + max(static["grads"] + activations, static["step_transient"])
        out.append(
            {
                "stage": r,
                **static,
                "buckets": buckets,
                "activations_per_microbatch": sum(per_chunk.values()),
                "microbatches_in_flight": inflight,
                "activations": activations,
                "total": int(total),
                "total_gib": round(total / GIB, 3),
            }
        )
    return out


def check_fit(stages: list[dict], device_gib: float | None) -> list[str]:
    """Mark every stage ``fits`` against ``memory.device_gib`` (None: no check); the warnings of those
    that do not."""
    warnings = []
    if device_gib is None:
        return warnings
    for s in stages:
        s["fits"] = s["total"] <= device_gib * GIB
        if not s["fits"]:
            warnings.append(
                f"msar-plan: pipeline rank {s['stage']} needs an estimated {s['total'] / GIB:.2f} GiB "
                f"> memory.device_gib={device_gib} (params {s['params'] / GIB:.2f}, grads {s['grads'] / GIB:.2f}, "
                f"optimizer {s['optimizer'] / GIB:.2f}, activations {s['activations'] / GIB:.2f} GiB)"
            )
    return warnings
