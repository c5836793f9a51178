"""Golden runs: today's numerics of every residual preset, pinned in ``tests/golden/``.

    python scripts/golden_runs.py            # (re)write tests/golden/*.json: every preset + the PP2 V2 run
    python scripts/golden_runs.py --check    # rerun and compare; exit 1 listing every value that moved
    python scripts/golden_runs.py --check msar mhc    # some presets only (names of configs/residual/*.yaml)

Each file holds the per-step values of a 20-step ``model=tiny`` run of one preset (``train/loss``,
``train/total_loss``, ``grad_norm``, ``moe/load_max_over_mean``), the platform that wrote it (torch,
DeepSpeed, CPU architecture, the SIMD level torch dispatches to, and the CPU's model, cache size and ISA
flags) and the tolerances used on another
platform. ``msar-pp2-v2.json`` also has ``comm/bytes_per_step`` of the same run on 2 pipeline ranks with 2
virtual stages each (the summary cache's traffic). The comparison is bitwise when the platform matches
the file's, else within the file's relative tolerances (bytes always exactly). One thread per run, so the
core count of the machine does not change the reduction order.

A change that moves these numbers must regenerate the files in the same commit and say why.

    python scripts/golden_runs.py --bf16 [presets]   # the same runs with parallel.dtype=bfloat16 on CPU

checks that every preset trains in bf16 (finite losses) within ``BF16_TOL`` nats of the fp32 golden
losses: each step, and the final step more tightly (rounding noise of a few hundredths of a nat is
normal per step early on, when the loss drops fastest; measured max 0.18 per step, 0.016 at step 20).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
STEPS = 20
RUN = [
    "model=tiny",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "parallel.grad_accum=1",
    f"trainer.max_steps={STEPS}",
    "trainer.warmup_steps=4",
    "trainer.log_every=1",
    f"trainer.eval_every={STEPS}",
    "trainer.eval_batches=1",
    "trainer.save_every=0",
    "trainer.threads=1",
    "trainer.progress=false",
    "trainer.resume=none",
    "logger.mode=disabled",
    "logger.residual_every=0",
    "logger.heatmap_every=0",
]
KEYS = ("train/loss", "train/total_loss", "grad_norm", "moe/load_max_over_mean")
# Another CPU / torch build reorders float reductions; 20 steps of Adam amplify a last-bit difference.
TOLERANCE = {"train/loss": 2e-3, "train/total_loss": 2e-3, "grad_norm": 3e-2, "moe/load_max_over_mean": 5e-2}
BF16_TOL = {"each_step": 0.3, "final": 0.05}  # nats, |bf16 - fp32 golden| of train/loss
PIPE = ["parallel=pp2", "parallel.virtual_stages=2"]
PIPE_PRESET = "msar"


def presets() -> list[str]:
    return sorted(p.stem for p in (REPO / "configs" / "residual").glob("*.yaml"))


def platform_facts() -> dict[str, str]:
    import deepspeed
    import torch

    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **cpu_identity(),
    }


# CPUID feature flags that select a BLAS / oneDNN kernel (and so a float summation order).
ISA_FLAG = re.compile(r"(avx|amx|fma|f16c|sse|ssse|bmi|adx|sha|vaes|vpclmul|gfni)")


def cpu_identity(cpuinfo: str | None = None) -> dict[str, str]:
    """CPU model, last-level cache and the ISA flags from /proc/cpuinfo.

    torch's SIMD level alone is too coarse: two machines that both report AVX512 gave different
    last bits in fp32 (MKL picks its GEMM kernel and blocking from CPUID and cache sizes), so a
    file written on one failed the bitwise check on the other."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"cpu": platform.processor() or "unknown"}

    def field(name: str) -> str:
        m = re.search(rf"^{name}\s*:\s*(.*)$", cpuinfo, re.M)
        return m.group(1).strip() if m else "unknown"

    flags = sorted(f for f in field("flags").split() if ISA_FLAG.match(f))
    return {"cpu": field("model name"), "cpu_cache": field("cache size"), "cpu_isa": " ".join(flags)}


def _rows(run_dir: Path, keys: tuple[str, ...]) -> list[dict]:
    from msar_train.train.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/total_loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    return [{"step": r["step"], **{k: r.get(k) for k in keys}} for r in rows]


def run_single(preset: str, root: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    """In this process (one DeepSpeed world of one, like a sweep's jobs)."""
    from msar_train.config import compose_config
    from msar_train.train.trainer import Trainer

    run_dir = root / preset
    Trainer(compose_config([*RUN, f"residual={preset}", *extra, f"trainer.run_dir={run_dir}"])).fit()
    return _rows(run_dir, KEYS)


def compare_bf16(name: str, rows: list[dict], golden: dict) -> list[str]:
    """bf16 losses against the fp32 golden ones (``BF16_TOL``); non-finite values always fail."""
    out = []
    for a, g in zip(rows, golden["steps"], strict=True):
        have, want = a["train/loss"], g["train/loss"]
        tol = BF16_TOL["final"] if g["step"] == STEPS else BF16_TOL["each_step"]
        if not math.isfinite(have) or abs(have - want) > tol:
            out.append(f"{name} bf16 step {g['step']} train/loss: {have!r}, fp32 golden {want!r} (tolerance {tol} nats)")
    return out


def run_pipeline(root: Path) -> list[dict]:
    run_dir = root / "pp2-v2"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # set by the in-process runs' world of one
    args = [str(REPO / "scripts" / "launch_local.sh"), "2", *RUN, f"residual={PIPE_PRESET}", *PIPE, f"trainer.run_dir={run_dir}"]
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the PP2 V2 run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return _rows(run_dir, (*KEYS, "comm/bytes_per_step"))


def record(name: str, overrides: list[str], rows: list[dict]) -> dict:
    return {
        "name": name,
        "overrides": overrides,
        "platform": platform_facts(),
        "tolerance_rel": TOLERANCE,
        "steps": rows,
    }


def compare(golden: dict, rows: list[dict]) -> list[str]:
    """Every value that moved: bitwise on the golden file's platform, else beyond its tolerance."""
    exact = golden["platform"] == platform_facts()
    tol = golden["tolerance_rel"]
    out = []
    if len(rows) != len(golden["steps"]):
        return [f"{golden['name']}: {len(rows)} steps, the golden file has {len(golden['steps'])}"]
    for a, g in zip(rows, golden["steps"], strict=True):
        for key, want in g.items():
            have = a.get(key)
            if key == "step" or have == want:
                continue
            if key == "comm/bytes_per_step" or exact or want is None or have is None:
                ok = False
            else:
                ok = abs(have - want) <= tol.get(key, 0.0) * max(abs(want), 1e-12)
            if not ok:
                how = "bitwise (same platform)" if exact else f"rel tol {tol.get(key)}"
                out.append(f"{golden['name']} step {g['step']} {key}: golden {want!r}, now {have!r} ({how})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with tests/golden instead of writing it")
    ap.add_argument("--no-pipeline", action="store_true", help="skip the 2-rank PP2 V2 run")
    ap.add_argument("--bf16", action="store_true", help="run in bfloat16 and compare with the fp32 golden losses")
    ap.add_argument("names", nargs="*", help="presets (default: every configs/residual/*.yaml)")
    args = ap.parse_args(argv)
    names = args.names or presets()
    unknown = sorted(set(names) - set(presets()))
    if unknown:
        ap.error(f"unknown presets {unknown}; choose from {presets()}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    moved: list[str] = []
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        dtype = ("parallel.dtype=bfloat16",) if args.bf16 else ()
        jobs = [(n, [f"residual={n}"], lambda n=n: run_single(n, Path(tmp), dtype)) for n in names]
        if not args.no_pipeline and not args.bf16 and PIPE_PRESET in names:
            jobs.append((f"{PIPE_PRESET}-pp2-v2", [f"residual={PIPE_PRESET}", *PIPE], lambda: run_pipeline(Path(tmp))))
        for name, overrides, make in jobs:
            path = GOLDEN / f"{name}.json"
            rows = make()
            if args.bf16:
                moved += compare_bf16(name, rows, json.loads(path.read_text()))
            elif args.check:
                if not path.is_file():
                    moved.append(f"{name}: no golden file {path} (run scripts/golden_runs.py)")
                    continue
                moved += compare(json.loads(path.read_text()), rows)
            else:
                path.write_text(json.dumps(record(name, [*RUN, *overrides], rows), indent=1) + "\n")
                print(f"wrote {path.relative_to(REPO)}", flush=True)
    if moved:
        print("golden values moved (regenerate with scripts/golden_runs.py in the same commit and say why):", file=sys.stderr)
        print("\n".join(moved), file=sys.stderr)
        return 1
    if args.check or args.bf16:
        print(f"golden runs match{' in bf16' if args.bf16 else ''}: {', '.join(n for n, _, _ in jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
