#!/usr/bin/env python
"""Step time, peak memory, parameter and FLOPs overhead of every residual backend, side by side.

    python scripts/bench_residuals.py [--config small] [--backends vanilla attnres msar mhc]
                                      [--kernel torch|triton|compile] [--batch 8] [--seq 128]
                                      [--steps 7] [--warmup 2] [--device cpu|cuda] [--dtype float32|bfloat16]
                                      [--no-hf] [--json OUT]

One process builds every model and times forward+backward steps *interleaved* (one step of each
backend per round), so a busy machine slows all of them alike; the table shows the median over
``--steps`` rounds after ``--warmup`` rounds, with min-max. Peak memory is the high-water mark of
tensor allocations during one extra step (CUDA: ``max_memory_allocated``; CPU: the profiler's
allocation events). FLOPs are analytic (matmuls and the residual math, forward+backward = 3x
forward). ``hf_deepseek_v3`` is transformers' ``DeepseekV3ForCausalLM`` at the same size and
routing (its attention is MLA, see docs/benchmarks.md); its row reports our vanilla model's
tokens/s over its tokens/s.

Prints a markdown table and the JSON list on stdout; ``--json OUT`` writes the list, one object
per backend with at least: backend, step_time_median_s, ratio_vs_vanilla, peak_mem_bytes,
param_overhead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from msar_train.config.schema import ModelConfig, ResidualConfig  # noqa: E402
from msar_train.model.flops import training_flops_per_token  # noqa: E402
from msar_train.model.transformer import Transformer, lm_loss  # noqa: E402

HF = "hf_deepseek_v3"


# Bench-only presets: (base model preset, fields changed). ``deep``: Block MSAR's 8 blocks over 48
# branches (6 targets per block, nearer the paper's depth than ``small``'s 2 per block).
BENCH_PRESETS = {"deep": ("small", {"n_layers": 24, "d_model": 256, "n_heads": 4, "n_kv_heads": 4})}


def model_config(name: str) -> ModelConfig:
    base, changes = BENCH_PRESETS.get(name, (name, {}))
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "configs" / "model" / f"{base}.yaml"), changes)
    return OmegaConf.to_object(node)


def residual_config(name: str, kernel: str) -> ResidualConfig:
    node = OmegaConf.merge(OmegaConf.structured(ResidualConfig), OmegaConf.load(ROOT / "configs" / "residual" / f"{name}.yaml"))
    res = OmegaConf.to_object(node)
    res.kernel = kernel
    return res


def hf_model(mc: ModelConfig):
    """transformers' DeepSeek-V3 at our size and routing (MLA attention with full-rank KV)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    head_dim = mc.head_dim or mc.d_model // mc.n_heads
    cfg = DeepseekV3Config(
        vocab_size=mc.vocab_size,
        hidden_size=mc.d_model,
        intermediate_size=mc.dense_hidden,
        moe_intermediate_size=mc.moe.expert_hidden,
        num_hidden_layers=mc.n_layers,
        num_attention_heads=mc.n_heads,
        num_key_value_heads=mc.n_kv_heads,
        n_shared_experts=mc.moe.n_shared,
        n_routed_experts=mc.moe.n_routed,
        num_experts_per_tok=mc.moe.top_k,
        first_k_dense_replace=mc.first_k_dense,
        n_group=mc.moe.n_group,
        topk_group=mc.moe.topk_group,
        norm_topk_prob=mc.moe.norm_topk_prob,
        routed_scaling_factor=mc.moe.routed_scaling_factor,
        q_lora_rank=None,
        kv_lora_rank=mc.d_model,
        qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim - head_dim // 2,
        v_head_dim=head_dim,
        max_position_embeddings=mc.max_seq_len,
        rms_norm_eps=mc.norm_eps,
        tie_word_embeddings=mc.tie_embeddings,
        use_cache=False,
        num_mtp_layers=0,
    )
    cfg._attn_implementation = "sdpa"
    return DeepseekV3ForCausalLM(cfg)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def peak_memory(step, device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def make_step(model, ids, hf: bool):
    def step():
        model.zero_grad(set_to_none=True)
        if hf:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss, _ = lm_loss(model(ids), ids)
        loss.backward()

    return step


def run(a) -> list[dict]:
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    mc = model_config(a.config)
    if a.layers:
        mc.n_layers = a.layers
    tokens = a.batch * a.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (a.batch, a.seq), generator=g).to(device)
    names = list(a.backends)
    if "vanilla" not in names:
        names.insert(0, "vanilla")
    models, steps, rows = {}, {}, {}
    for name in names:
        base, _, variant = name.partition("@")  # msar@per_target: one phase 1 per target (no block batching)
        if variant not in ("", "per_target"):
            raise SystemExit(f"bench_residuals: backend {name!r}: the only variant is @per_target")
        res = residual_config(base, a.kernel)
        if res.n_blocks is not None and res.n_blocks > 2 * mc.n_layers:  # shrunk test models
            res.n_blocks = 2 * mc.n_layers
        m = Transformer(mc, res, seed=0).to(device=device, dtype=dtype)
        if variant:
            m.backend.kernel.batched = False
        models[name], steps[name] = m, make_step(m, ids, False)
        kernel = a.kernel if base.startswith(("attnres", "msar")) else "-"
        rows[name] = {"backend": name, "kernel": kernel + (" (per target)" if variant else "")}
        rows[name]["params"] = n_params(m)
        rows[name]["flops"] = tokens * training_flops_per_token(mc, res, a.seq)
    if a.hf:
        m = hf_model(mc).to(device=device, dtype=dtype)
        models[HF], steps[HF] = m, make_step(m, ids, True)
        rows[HF] = {"backend": HF, "kernel": "-", "params": n_params(m), "flops": None}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(a.warmup + a.steps):
        for k, step in steps.items():
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if r >= a.warmup:
                times[k].append(time.perf_counter() - t0)
    for k, step in steps.items():
        rows[k]["peak_mem_bytes"] = peak_memory(step, a.device)
    van = rows["vanilla"]
    van_t = statistics.median(times["vanilla"])
    out = []
    for k in steps:
        row = rows[k]
        t = times[k]
        row["step_time_median_s"] = statistics.median(t)
        row["step_time_min_s"], row["step_time_max_s"] = min(t), max(t)
        row["ratio_vs_vanilla"] = row["step_time_median_s"] / van_t
        row["tokens_per_s"] = tokens / row["step_time_median_s"]
        row["peak_mem_ratio_vs_vanilla"] = row["peak_mem_bytes"] / van["peak_mem_bytes"]
        row["param_overhead"] = row["params"] / van["params"] - 1.0
        row["flops_overhead"] = None if row["flops"] is None else row["flops"] / van["flops"] - 1.0
        if k == HF:
            row["vanilla_tokens_per_s_ratio"] = van["tokens_per_s"] / row["tokens_per_s"]
        row.update(config=a.config, batch=a.batch, seq=a.seq, dtype=a.dtype, device=a.device, steps=a.steps)
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| backend | kernel | step time median s (min-max) | x vanilla | tokens/s | peak mem MiB | x vanilla "
        "| params | param overhead | FLOPs overhead |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fo = "n/a" if r["flops_overhead"] is None else f"{100 * r['flops_overhead']:+.2f}%"
        lines.append(
            f"| {r['backend']} | {r['kernel']} | {r['step_time_median_s']:.3f} ({r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f}) "
            f"| {r['ratio_vs_vanilla']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_mem_bytes'] / 2**20:.1f} "
            f"| {r['peak_mem_ratio_vs_vanilla']:.3f} "
            f"| {r['params'] / 1e6:.2f}M | {100 * r['param_overhead']:+.2f}% | {fo} |"
        )
    hf = [r for r in rows if r["backend"] == HF]
    if hf:
        lines.append(f"\nour vanilla tokens/s / {HF} tokens/s = {hf[0]['vanilla_tokens_per_s_ratio']:.3f}")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", help="model preset (configs/model/*.yaml) or a bench preset: deep")
    ap.add_argument("--backends", nargs="+", default=["vanilla", "attnres", "msar", "mhc"], help="residual presets")
    ap.add_argument("--kernel", default="torch", choices=["torch", "triton", "compile"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="override model.n_layers (tests)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hf", dest="hf", action="store_true", default=True)
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = run(a)
    print(f"# bench_residuals {datetime.date.today()} model={a.config} B={a.batch} T={a.seq} {a.dtype} {a.device} kernel={a.kernel}")
    print(table(rows))
    print(json.dumps(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
