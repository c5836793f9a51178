#!/usr/bin/env bash
# GPU acceptance in one command, for when a CUDA GPU is lent (issue 14 item 5; never part of CI):
#   scripts/gpu_acceptance.sh [--dry-run] [REPORT_DIR]        # REPORT_DIR defaults to $OUT, else runs/gpu_acceptance-<time>
# Steps, each under its own time limit (total under 8 minutes on one H200):
#   1. tests     the Triton and lean-kernel tests on the GPU (Triton vs torch parity, fp32 and bf16, every
#                kernel, document masking; with CUDA present they run natively, not in the interpreter)
#   2. bench     scripts/bench_residuals.py --device cuda --dtype bfloat16 --kernel triton at `small`
#   3. bench_1b  the same at moe_10b cut to 8 layers (~1.1B active parameters), with MFU against the
#                dense bf16 peak (989 TFLOP/s, H100/H200 SXM)
#   4. train     a 50-step msar-train run of that preset with 16 routed experts (bf16, Triton kernels)
# REPORT_DIR/report.json: per step its command, exit code and seconds; MFU per backend; the train run's
# last loss. --dry-run prints the plan and checks, without a GPU, that every step's command is well
# formed (the training overrides compose, the benchmark accepts its flags); exit 2 if one is not.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
case "${1:-}" in -*) echo "gpu_acceptance.sh: unknown option '$1' (usage: [--dry-run] [REPORT_DIR])" >&2; exit 2;; esac
report=${1:-${OUT:-runs/gpu_acceptance-$(date +%Y%m%d-%H%M%S)}}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}

preset_1b=(model=moe_10b model.n_layers=8)
# The train step keeps 16 of the 64 routed experts (same ~1.1B active, 1.7B total): its end-of-run
# checkpoint with AdamW states is ~24 GB instead of ~64 GB (the device's disk is 64 GiB).
train_overrides=("${preset_1b[@]}" model.moe.n_routed=16 residual=msar residual.kernel=triton data=shakespeare data.seq_len=1024
  parallel.micro_batch_size=4 trainer.max_steps=50 trainer.warmup_steps=5 trainer.eval_every=50
  trainer.eval_batches=2 trainer.save_every=50 trainer.log_every=10 trainer.resume=none logger.mode=disabled
  "trainer.run_dir=$report/train")

names=(tests bench bench_1b train)
limits=(120 90 120 150)
cmds=(
  "$PY -m pytest -q -p no:cacheprovider -m 'not slow' tests/unit/test_kernels_triton.py tests/unit/test_kernels.py --junitxml=$report/tests.xml"
  "$PY scripts/bench_residuals.py --config small --device cuda --dtype bfloat16 --kernel triton --batch 8 --seq 1024 --steps 10 --warmup 3 --no-hf --json $report/bench_small.json"
  "$PY scripts/bench_residuals.py --config moe_10b --layers 8 --backends vanilla attnres msar --device cuda --dtype bfloat16 --kernel triton --batch 2 --seq 2048 --steps 6 --warmup 2 --no-hf --json $report/bench_1b.json"
  "$PY -m msar_train.train.cli ${train_overrides[*]}"
)

total=0
for l in "${limits[@]}"; do total=$((total + l)); done
echo "gpu_acceptance: report in $report/report.json; peak ${PEAK_TFLOPS} TFLOP/s; time limits total ${total}s"
for i in "${!names[@]}"; do
  printf '  %-9s (limit %3ss)  %s\n' "${names[$i]}" "${limits[$i]}" "${cmds[$i]}"
done

if [ "$dry" = 1 ]; then
  # Without a GPU: the plan must still be runnable as written.
  "$PY" -m msar_train.train.cli --cfg "${train_overrides[@]}" > /dev/null \
    || { echo "gpu_acceptance.sh: the train step's overrides do not compose (above)" >&2; exit 2; }
  help=$("$PY" scripts/bench_residuals.py --help) || { echo "gpu_acceptance.sh: bench_residuals.py --help failed" >&2; exit 2; }
  for flag in --config --layers --backends --device --dtype --kernel --batch --seq --steps --warmup --no-hf --json; do
    grep -q -- "$flag" <<< "$help" || { echo "gpu_acceptance.sh: bench_residuals.py has no $flag" >&2; exit 2; }
  done
  for f in tests/unit/test_kernels_triton.py tests/unit/test_kernels.py; do
    [ -f "$f" ] || { echo "gpu_acceptance.sh: missing $f" >&2; exit 2; }
  done
  echo "gpu_acceptance: dry run ok (nothing run)"
  exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_acceptance.sh: no CUDA GPU here (use --dry-run to check the plan)" >&2; exit 2; }
mkdir -p "$report"
status=0
: > "$report/steps.tsv"
for i in "${!names[@]}"; do
  echo "== ${names[$i]}"
  t0=$(date +%s.%N)
  timeout "${limits[$i]}" bash -c "${cmds[$i]}" > "$report/${names[$i]}.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  tail -5 "$report/${names[$i]}.log"
  printf '%s\t%s\t%s\n' "${names[$i]}" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')" >> "$report/steps.tsv"
  [ "$rc" -eq 0 ] || status=1
done
"$PY" - "$report" "$PEAK_TFLOPS" <<'EOF'
import json, sys
from pathlib import Path

rep, peak = Path(sys.argv[1]), float(sys.argv[2]) * 1e12
out = {"peak_flops": peak, "steps": {}}
for line in (rep / "steps.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    out["steps"][name] = {"rc": int(rc), "seconds": float(secs), "log": f"{name}.log"}
for name in ("bench_small", "bench_1b"):
    f = rep / f"{name}.json"
    if f.exists():
        rows = json.loads(f.read_text())
        out[name] = [
            {**{k: r.get(k) for k in ("backend", "kernel", "step_time_median_s", "ratio_vs_vanilla", "peak_mem_bytes")},
             "mfu": (r["flops"] / r["step_time_median_s"] / peak) if r.get("flops") else None}
            for r in rows
        ]
m = rep / "train" / "metrics.jsonl"
if m.exists():
    rows = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
    losses = [r for r in rows if "train/loss" in r]
    if losses:
        out["train"] = {"last_step": losses[-1].get("step"), "last_loss": losses[-1]["train/loss"]}
(rep / "report.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out))
EOF
exit "$status"
