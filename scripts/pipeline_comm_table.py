#!/usr/bin/env python
"""Cluster-scale pipeline traffic of Block MSAR with and without the cross-stage summary cache.

    python scripts/pipeline_comm_table.py [--pp 4 8 16] [--vp 2 4] [--blocks 8 16] [--d-model 7168]
                                          [--layers 64] [--seq 4096] [--json OUT]

For every (P, V, N) it builds the config (``model=moe_28b`` reshaped to ``--layers`` blocks of width
``--d-model``, ``residual=msar`` with N blocks, ``--partition`` (uniform) into C = P V chunks, micro-batch 1,
bfloat16) and computes, from the same hop plan the interleaved engine sends by (``parallel/comm.py``):

- ``summary_fwd_naive`` / ``summary_fwd_cached``: completed-summary elements per token sent forward per
  micro-batch, in units of d (what the AttnRes paper's formulas count), next to the formulas
  ``C(C-1)/2 N_p`` and ``P(P-1)/2 N_p + (V-1) P^2 N_p`` with ``N_p = N / C`` blocks per chunk;
- ``step_GB_naive`` / ``step_GB_cached``: all point-to-point bytes of one pipeline per micro-batch,
  both directions (summaries, the partial summary, the aux scalar and their gradients), in GB.

The formulas assume every chunk completes exactly N_p blocks; a real layout completes whole blocks at
block ends, so the computed figures differ where N / C is not an integer. Ours also count the embedding
b_0 (a source of every layer). With chunks aligned to blocks (``--partition blocks``, N = C N_p): naive =
paper + (C - 1) (b_0 on every hop); cached = sum over the first P - 1 hops of (1 + c N_p) plus
(P - 1) N_p on each of the other C - P hops (the chunks run since the receiving rank last held the
micro-batch), where the paper's second term counts P N_p per hop. Nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from msar_train.config import compose_config
from msar_train.parallel.comm import chunk_cut_specs, completed_summaries, hop_plan, paper_elements_per_token
from msar_train.parallel.partition import partition
from msar_train.residual import build_backend


def row(P: int, V: int, N: int, d: int, layers: int, seq: int, partition_method: str = "uniform") -> dict:
    cfg = compose_config(
        [
            "model=moe_28b",
            f"model.n_layers={layers}",
            f"model.d_model={d}",
            f"model.n_heads={d // 128}",
            f"model.n_kv_heads={d // 128}",
            "residual=msar",
            f"residual.n_blocks={N}",
            f"parallel.pp_stages={P}",
            f"parallel.virtual_stages={V}",
            f"parallel.grad_accum={P}",
            f"parallel.partition_method={partition_method}",
            "parallel.micro_batch_size=1",
            "parallel.dtype=bfloat16",
            f"data.seq_len={seq}",
        ]
    )
    m = cfg.model
    C = P * V
    backend = build_backend(cfg.residual, m.n_layers, m.d_model, m.norm_eps, m.init_std)
    parts = partition(m, cfg.residual, C, partition_method)
    specs = chunk_cut_specs(backend, parts, 1, seq, torch.bfloat16, False)
    tokens = seq
    out = {"P": P, "V": V, "N": N, "C": C}
    for name, cache in (("naive", False), ("cached", True)):
        hops = hop_plan(specs, P, cache=cache)
        summary = sum(h.specs[i].nbytes for h in hops.values() for i in h.send if h.specs[i].kind == "summary")
        out[f"summary_fwd_{name}"] = summary / 2 / tokens / d  # bf16 elements per token, in units of d
        out[f"step_GB_{name}"] = sum(h.bytes for h in hops.values()) / 1e9
    assert completed_summaries(backend, m.n_layers) == N + 1
    paper_naive, paper_cached = paper_elements_per_token(P, V, N / C, 1)
    out["paper_naive"], out["paper_cached"] = paper_naive, paper_cached
    out["saving"] = 1 - out["step_GB_cached"] / out["step_GB_naive"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--vp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--d-model", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--partition", choices=["uniform", "parameters", "blocks"], default="uniform")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = []
    try:
        for P in a.pp:
            for V in a.vp:
                for N in a.blocks:
                    rows.append(row(P, V, N, a.d_model, a.layers, a.seq, a.partition))
    except ValueError as e:
        print(f"pipeline_comm_table: {e}", file=sys.stderr)
        return 2
    print(
        f"d={a.d_model}, {a.layers} blocks, seq {a.seq}, micro-batch 1, bf16, {a.partition} partition; "
        "summary columns: elements per token / d, forward"
    )
    print()
    print("| P | V | N | C | summaries naive | paper naive | summaries cached | paper cached | GB/micro-batch naive | cached | saving |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['P']} | {r['V']} | {r['N']} | {r['C']} | {r['summary_fwd_naive']:.1f} | {r['paper_naive']:.1f} | "
            f"{r['summary_fwd_cached']:.1f} | {r['paper_cached']:.1f} | {r['step_GB_naive']:.2f} | {r['step_GB_cached']:.2f} | "
            f"{100 * r['saving']:.0f}% |"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
