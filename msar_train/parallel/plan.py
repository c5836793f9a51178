"""``msar-plan [hydra overrides]``: the pipeline plan as one JSON object, without allocating weights.

What it reports (``plan(cfg)``):
    stages:     per pipeline rank its parameter count (modules shared by several layers of one rank
                counted once; every rank holding a shared module counts its replica; experts unsharded,
                i.e. before ``parallel.ep_size``), its ``chunks`` (``parallel.virtual_stages`` of them, chunk
                ``c`` on rank ``c mod P``) with their ``layers`` ranges ``[start, stop)`` in
                ``Transformer.layers()`` indices (0 = the embedding, ``n_layers + 1`` = the head), and with one
                chunk per rank also ``layers`` directly.
    boundaries: per cut the flat carry that DeepSpeed sends forward once per micro-batch:
                ``(aux, [doc_ids, positions,] *state)`` (``model/layers.py``), with the residual state from
                the backend's ``state_shapes``/``state_names``. ``after_layer`` is the index in
                ``Transformer.layers()`` of the last layer before the cut, which is also the number of
                transformer blocks done (the ``after_layer`` of ``ResidualBackend.state_shapes``).
                ``hop_bytes_naive`` / ``hop_bytes_cached``: that hop's bytes per micro-batch, both directions,
                without / with the cross-stage summary cache (``comm.py``).
    comm_bytes_naive / comm_bytes_cached: point-to-point bytes of one pipeline per training step
                (``grad_accum`` micro-batches, both directions), the figures the interleaved engine
                measures as ``comm/bytes_per_step``; ``comm_paper_summary_bytes_*``: the AttnRes paper's
                formulas for the summary part of the forward traffic, for comparison.
    memory:     per pipeline rank the estimated peak bytes and its parts (``parallel/memory.py``): params,
                grads, optimizer, activations (the in-flight micro-batches' and the worst layer's
                transient), step_transient, total / total_gib, and with ``memory.device_gib`` set also
                ``fits``. ``memory_world_size`` is the world the estimate assumes (``memory.world_size``,
                else WORLD_SIZE, else ``pp_stages * ep_size``). A rank that does not fit is named on stderr
                and msar-plan exits 1 after printing the plan (docs/decisions.md).

Shapes use B = ``parallel.micro_batch_size`` and T = ``data.seq_len``; float tensors have the activation
dtype (``parallel.dtype``; ``auto`` = bfloat16 when CUDA is visible, else float32), document-mask tensors are
int64. The layer ranges are the ones the pipeline engine uses (``parallel/partition.py``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from omegaconf import DictConfig

from msar_train.model.transformer import layer_specs
from msar_train.parallel.comm import carry_specs, comm_plan
from msar_train.parallel.ds_config import resolve_dtype
from msar_train.parallel.memory import check_fit, memory_plan
from msar_train.parallel.partition import partition
from msar_train.residual import build_backend

EXIT_DOES_NOT_FIT = 1  # the plan is valid but some rank's estimate exceeds memory.device_gib (docs/decisions.md)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64"}


def boundary_tensors(backend, after_layer: int, batch: int, seq: int, dtype: torch.dtype, document_mask: bool) -> list[dict]:
    """The carry after ``layers()[after_layer]``, in the order it is sent (``comm.carry_specs``), named."""
    specs = carry_specs(backend, after_layer, batch, seq, dtype, document_mask)
    names = ["aux", *(["doc_ids", "positions"] if document_mask else []), *backend.state_names(after_layer)]
    return [
        {"name": n, "shape": list(t.shape), "dtype": _DTYPE_NAMES[t.dtype], "bytes": t.nbytes, "kind": t.kind}
        for n, t in zip(names, specs, strict=True)
    ]


def stage_param_counts(cfg: DictConfig, backend, ranges: list[list[tuple[int, int]]]) -> list[int]:
    """Parameters per pipeline rank (``ranges[r]``: its chunks' layer ranges), built on the meta device
    (modules shared by several layers of one rank counted once)."""
    specs = layer_specs(cfg.model, backend, cfg.data.document_mask)
    with torch.device("meta"):
        layers = [cls(*args) for cls, args in specs]
    counts = []
    for chunks in ranges:
        seen: dict[int, int] = {}
        for start, stop in chunks:
            for layer in layers[start:stop]:
                for p in layer.parameters():
                    seen[id(p)] = p.numel()
        counts.append(sum(seen.values()))
    return counts


def memory_world_size(cfg: DictConfig) -> int:
    p = cfg.parallel
    if cfg.memory.world_size is not None:
        return cfg.memory.world_size
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return p.pp_stages * p.ep_size


def plan(cfg: DictConfig) -> dict:
    m, p = cfg.model, cfg.parallel
    P, V = p.pp_stages, p.get("virtual_stages", 1)
    C = P * V
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(p, device_type)
    B, T = p.micro_batch_size, cfg.data.seq_len
    parts = partition(m, cfg.residual, C, p.partition_method)
    backend = build_backend(cfg.residual, m.n_layers, m.d_model, m.norm_eps, m.init_std)
    ranges = [[(parts[c], parts[c + 1]) for c in range(r, C, P)] for r in range(P)]
    params = stage_param_counts(cfg, backend, ranges)
    stages = []
    for r in range(P):
        stage = {"stage": r, "params": params[r]}
        if V == 1:
            stage["layers"] = list(ranges[r][0])
        stage["chunks"] = [{"chunk": c, "layers": list(ranges[r][i])} for i, c in enumerate(range(r, C, P))]
        stages.append(stage)
    comm = comm_plan(cfg)
    boundaries = []
    for c, cut in enumerate(parts[1:-1], start=1):
        after = cut - 1
        tensors = boundary_tensors(backend, after, B, T, dtype, cfg.data.document_mask)
        state = [t for t in tensors if t["kind"] in ("summary", "state")]
        boundaries.append(
            {
                "after_layer": after,
                "from_stage": (c - 1) % P,
                "to_stage": c % P,
                "tensors": [{k: t[k] for k in ("name", "shape", "dtype")} for t in tensors],
                "bytes_per_microbatch": sum(t["bytes"] for t in tensors),
                "state_bytes_per_microbatch": sum(t["bytes"] for t in state),
            }
        )
        if P > 1:  # both directions (activations forward, their gradients back), per micro-batch
            boundaries[-1]["hop_bytes_naive"] = comm["comm_hop_bytes_naive"][c - 1]
            boundaries[-1]["hop_bytes_cached"] = comm["comm_hop_bytes_cached"][c - 1]
    world = memory_world_size(cfg)
    memory = memory_plan(cfg, backend, ranges, dtype, world)
    warnings = check_fit(memory, cfg.memory.device_gib)
    return {
        "model": m.name,
        "residual": cfg.residual.name,
        "n_layers": m.n_layers,
        "pp_stages": P,
        "virtual_stages": V,
        "partition_method": p.partition_method,
        "micro_batch_size": B,
        "grad_accum": p.grad_accum,
        "seq_len": T,
        "dtype": _DTYPE_NAMES[dtype],
        "document_mask": bool(cfg.data.document_mask),
        "stages": stages,
        "boundaries": boundaries,
        "comm_bytes_naive": comm["comm_bytes_naive"],
        "comm_bytes_cached": comm["comm_bytes_cached"],
        "comm_paper_summary_bytes_naive": comm.get("comm_paper_summary_bytes_naive", 0),
        "comm_paper_summary_bytes_cached": comm.get("comm_paper_summary_bytes_cached", 0),
        "memory_world_size": world,
        "zero_stage": p.zero_stage,
        "ep_size": p.ep_size,
        "activation_checkpointing": bool(p.activation_checkpointing),
        "memory_device_gib": cfg.memory.device_gib,
        "memory": memory,
        "memory_warnings": warnings,
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    from msar_train.config import compose_config

    try:
        cfg = compose_config(args)
        out = plan(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"msar-plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    for w in out["memory_warnings"]:
        print(w, file=sys.stderr)
    return EXIT_DOES_NOT_FIT if out["memory_warnings"] else 0


if __name__ == "__main__":
    sys.exit(main())
