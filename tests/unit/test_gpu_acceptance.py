"""scripts/gpu_acceptance.sh (issue 14 item 5): its dry run checks the plan on CPU, in CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_dry_run_prints_the_plan_and_checks_it(tmp_path):
    proc = _run("--dry-run", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "dry run ok" in out
    steps = re.findall(r"^\s+(\w+)\s+\(limit\s+(\d+)s\)\s+(.*)$", out, flags=re.M)
    assert [s[0] for s in steps] == ["tests", "bench", "bench_1b", "train"]
    assert sum(int(s[1]) for s in steps) <= 480  # the 8 minutes on one H200
    cmd = dict((s[0], s[2]) for s in steps)
    assert "--device cuda --dtype bfloat16 --kernel triton" in cmd["bench"]
    assert "--config moe_10b --layers 8" in cmd["bench_1b"]
    assert "trainer.max_steps=50" in cmd["train"] and "residual.kernel=triton" in cmd["train"]
    assert str(tmp_path / "rep") in out
    assert not (tmp_path / "rep").exists()  # a dry run writes nothing


def test_unknown_option_exits_2(tmp_path):
    proc = _run("--bogus")
    assert proc.returncode == 2 and "unknown option '--bogus'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal without a GPU")
def test_real_run_without_a_gpu_is_refused(tmp_path):
    proc = _run(str(tmp_path / "rep"))
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "rep").exists()
