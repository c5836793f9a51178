"""scripts/bench_data.py runs end to end on a tiny setting and reports every stage (no timing asserts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_data_reports_every_stage(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_data.py"), "--model", "tiny", "--seq", "32", "--micro-batch", "2",
           "--num-proc", "1", "--loader-batches", "20", "--train-steps", "1", "--repeats", "1", "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["num_proc"] for r in data["tokenization"]] == [1]
    tok = data["tokenization"][0]
    assert tok["input_mb"] > 1 and tok["mb_per_s"] > 0 and tok["tokens_per_s"] > 0
    assert data["loader"]["tokens_per_s_median"] > 0 and data["training"]["tokens_per_s"] > 0
    ratio = data["loader"]["tokens_per_s_median"] / data["training"]["tokens_per_s"]
    assert abs(data["loader_over_training"] - ratio) <= 1e-9 * ratio
    assert data["target_met"] == (ratio >= 50)
    assert "loader / training" in res.stdout and "| tokenization |" in res.stdout


def test_bench_data_rejects_bad_flags(tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_data.py"), "--repeats", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 2 and "--repeats" in res.stderr
