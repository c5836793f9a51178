"""Estimated (``msar-plan``'s ``memory``) vs measured peak memory per rank of real CPU training runs.

    python scripts/measure_memory.py [--layouts single,pp2,pp2_ep2,pp2_v2] [--repeat N] [--json OUT] [--markdown]
    python scripts/measure_memory.py --presets        # the moe_10b/18b/28b table on 8-64 GPUs (estimates only)
    ... --update-docs                                 # also write the table into docs/pipeline.md (between its markers)

Each layout trains ``STEPS`` steps of a tiny vanilla MoE model with activation checkpointing off and on,
one torchrun launch per layout and setting; every rank measures the high-water mark of its live tensor
bytes (``msar_train/parallel/memtrack.py``: a TorchDispatchMode, entered before the engine is built, so
parameters, DeepSpeed's flat buffers, optimizer states, activations, received pipeline tensors and
gradients are all seen) and compares it with the plan's estimate for its pipeline rank. Prints one row
per (layout, checkpointing, rank) with the ratio estimate / measured (medians over ``--repeat`` runs).
``--worker OUT overrides...`` is the per-rank entry point the driver launches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = 3
BASE = [
    "model=tiny",
    "residual=vanilla",
    "data.seq_len=64",
    "parallel.micro_batch_size=4",
    "parallel.grad_accum=4",
    "parallel.dtype=float32",
    "trainer.seed=0",
    # ZeRO-1's reduction buffers are 5e8 elements by default (1.9 GiB fp32 each, allocated whole): the
    # estimate counts them, but at that size they would hide everything else of a tiny model
    "+parallel.deepspeed_overrides.zero_optimization.reduce_bucket_size=1000000",
]
# name -> (ranks, overrides)
LAYOUTS = {
    "single": (1, ["parallel=single"]),
    "pp2": (2, ["parallel=pp2", "parallel.partition_method=uniform"]),
    "pp2_ep2": (4, ["parallel=pp2_ep2", "parallel.partition_method=uniform"]),
    "pp2_v2": (2, ["parallel=pp2", "parallel.partition_method=uniform", "parallel.virtual_stages=2", "parallel.summary_cache=false"]),
    # the other residual backends' state: mHC's n streams, Block MSAR's open summaries and conv streams
    "single_mhc": (1, ["parallel=single", "residual=mhc"]),
    "single_msar": (1, ["parallel=single", "residual=msar"]),
    "pp2_msar": (2, ["parallel=pp2", "residual=msar"]),
}
PRESETS = ["moe_10b", "moe_18b", "moe_28b"]
# (GPUs, PP, EP): DP = GPUs / PP; every preset has 64 routed experts
PRESET_LAYOUTS = [(8, 8, 1), (8, 4, 2), (16, 8, 2), (16, 4, 4), (32, 8, 4), (32, 4, 8), (64, 8, 8), (64, 4, 16)]
PRESET_COMMON = [
    "parallel.dtype=bfloat16",
    "parallel.zero_stage=1",
    "parallel.activation_checkpointing=true",
    "parallel.micro_batch_size=1",
    "parallel.grad_accum=16",
    "data.seq_len=4096",
    "residual=msar",
]


# ------------------------------------------------------------------------------------------ worker
class _Batch:
    def __init__(self, ids, labels):
        self.input_ids_BT, self.labels_BT = ids, labels


def worker(out: Path, overrides: list[str]) -> None:
    import torch

    from msar_train.config import compose_config
    from msar_train.parallel.memtrack import LiveBytes
    from msar_train.parallel.plan import plan

    cfg = compose_config(overrides)
    rank = int(os.environ.get("RANK", "0"))
    with LiveBytes() as tracker:
        from msar_train.parallel.engine import Engine

        engine = Engine(cfg)
        after_init, after_steps = tracker.live, []
        p = cfg.parallel
        B, T, V = p.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + engine.dp_rank)
            batches = []
            for _ in range(p.grad_accum):
                ids = torch.randint(0, V, (B, T + 1), generator=g)
                batches.append(_Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
            torch.manual_seed(step)
            engine.train_step(batches)
            after_steps.append(tracker.live)
        peak = tracker.peak
    est = plan(cfg)["memory"][engine.stage]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {"rank": rank, "stage": engine.stage, "measured": peak, "estimate": est, "after_init": after_init, "after_steps": after_steps}
        )
    )


# ------------------------------------------------------------------------------------------ driver
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", WANDB_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, checkpointing: bool, out: Path, timeout_s: int = 600) -> list[dict]:
    """Launch one measured run; its per-rank records (rank order)."""
    nproc, overrides = LAYOUTS[name]
    args = [*BASE, *overrides, f"parallel.activation_checkpointing={str(checkpointing).lower()}"]
    if nproc == 1:
        cmd = [sys.executable, __file__, "--worker", str(out), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(_free_port()), __file__, "--worker", str(out), *args]
    proc = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} checkpointing={checkpointing} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def measure(layouts: list[str], repeat: int = 1, root: Path | None = None) -> list[dict]:
    """One row per (layout, checkpointing, rank): estimate, measured (median of ``repeat``), ratio."""
    rows = []
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for name in layouts:
            for ckpt in (False, True):
                runs = [run_layout(name, ckpt, Path(tmp) / f"{name}-{ckpt}-{i}") for i in range(repeat)]
                for r, rec in enumerate(runs[0]):
                    measured = int(statistics.median(run[r]["measured"] for run in runs))
                    est = rec["estimate"]
                    rows.append(
                        {
                            "layout": name,
                            "checkpointing": ckpt,
                            "rank": r,
                            "stage": rec["stage"],
                            "estimate": est["total"],
                            "measured": measured,
                            "ratio": est["total"] / measured,
                            "parts": {
                                k: est[k] for k in ("params", "grads", "optimizer", "buckets", "activations", "microbatches_in_flight")
                            },
                        }
                    )
    return rows


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def markdown(rows: list[dict]) -> str:
    head = "| layout | ckpt | rank (stage) | params | grads | optimizer | buckets | activations (in flight) | estimate MiB | measured MiB | est/meas |"  # noqa: E501
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts"]
        lines.append(
            f"| {r['layout']} | {'on' if r['checkpointing'] else 'off'} | {r['rank']} ({r['stage']}) | {_mib(p['params'])} | "
            f"{_mib(p['grads'])} | {_mib(p['optimizer'])} | {_mib(p['buckets'])} | {_mib(p['activations'])} ({p['microbatches_in_flight']}) | "  # noqa: E501
            f"{_mib(r['estimate'])} | {_mib(r['measured'])} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def preset_rows() -> list[dict]:
    from msar_train.config import compose_config
    from msar_train.parallel.plan import plan

    rows = []
    for model in PRESETS:
        for gpus, pp, ep in PRESET_LAYOUTS:
            cfg = compose_config(
                [
                    f"model={model}",
                    f"parallel.pp_stages={pp}",
                    f"parallel.ep_size={ep}",
                    f"memory.world_size={gpus}",
                    "memory.device_gib=141",
                ]
                + PRESET_COMMON
            )
            out = plan(cfg)
            worst = max(out["memory"], key=lambda s: s["total"])
            rows.append(
                {
                    "model": model,
                    "gpus": gpus,
                    "pp": pp,
                    "ep": ep,
                    "dp": gpus // pp,
                    "worst_stage": worst["stage"],
                    "worst": worst,
                    "stages_gib": [s["total_gib"] for s in out["memory"]],
                    "fits": all(s["fits"] for s in out["memory"]),
                }
            )
    return rows


def preset_markdown(rows: list[dict]) -> str:
    lines = [
        "| model | GPUs | PP x EP x DP | worst rank | params | grads | optimizer | buckets | activations | peak GiB | min-max over ranks GiB | fits 141 GiB |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    g = 2**30
    for r in rows:
        w = r["worst"]
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['pp']} x {r['ep']} x {r['dp']} | {r['worst_stage']} | {w['params'] / g:.1f} | "
            f"{w['grads'] / g:.1f} | {w['optimizer'] / g:.1f} | {w['buckets'] / g:.1f} | {w['activations'] / g:.1f} | {w['total'] / g:.1f} | "  # noqa: E501
            f"{min(r['stages_gib']):.1f}-{max(r['stages_gib']):.1f} | {'yes' if r['fits'] else 'no'} |"
        )
    return "\n".join(lines)


DOCS = REPO / "docs" / "pipeline.md"


def update_docs(key: str, table: str, path: Path = DOCS) -> None:
    """Replace the text between ``<!-- measure_memory:KEY -->`` and ``<!-- /measure_memory:KEY -->``."""
    start, end = f"<!-- measure_memory:{key} -->", f"<!-- /measure_memory:{key} -->"
    text = path.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"measure_memory: {path} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(Path(argv[1]), argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--repeat", type=int, default=1, help="runs per setting (medians of the measured peaks)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--markdown", action="store_true", help="print the rows as a markdown table")
    ap.add_argument("--presets", action="store_true", help="the moe_10b/18b/28b estimates on 8-64 GPUs instead")
    ap.add_argument("--update-docs", action="store_true", help="write the markdown table into docs/pipeline.md")
    a = ap.parse_args(argv)
    if a.presets:
        rows = preset_rows()
        table = preset_markdown(rows)
        print(table if a.markdown else json.dumps(rows, indent=1))
        if a.update_docs:
            update_docs("presets", table)
    else:
        layouts = a.layouts.split(",")
        unknown = sorted(set(layouts) - set(LAYOUTS))
        if unknown or a.repeat < 1:
            print(f"measure_memory: --layouts {unknown} not in {sorted(LAYOUTS)} or --repeat < 1", file=sys.stderr)
            return 2
        rows = measure(layouts, a.repeat)
        table = markdown(rows)
        print(table if a.markdown else json.dumps(rows, indent=1))
        if a.update_docs:
            update_docs("measured", table)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
