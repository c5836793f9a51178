"""Every depth-attention Triton kernel compiles for sm_90 at the issue's widths without register spills.

Runs ``scripts/triton_compile_table.py`` in its own process (the compiler, not the interpreter: the
unit tests of the kernels set TRITON_INTERPRET=1 for this process). No GPU is needed: triton lowers
to PTX on the CPU and the ptxas shipped in the triton wheel reports registers and spills.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
WIDTHS = [384, 2048, 2560, 4096, 7168]


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "table.json"
    cmd = [sys.executable, "scripts/triton_compile_table.py", "--json", str(out), "--widths", *map(str, WIDTHS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text()) if out.exists() else None
    assert report is not None, proc.stdout + proc.stderr
    rows = report["rows"]
    kernels = {r["kernel"] for r in rows}
    assert len(kernels) == 7
    assert {(r["d_model"], r["dtype"], r["doc_mask"]) for r in rows} == {
        (d, t, m) for d in WIDTHS for t in ("fp32", "bf16") for m in (False, True)
    }
    assert report["problems"] == [], report["problems"]
    assert proc.returncode == 0, proc.stderr
    for r in rows:
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] <= 232448, r
        assert r["BLOCK_D"] <= 128, r


def test_the_table_flags_a_spill():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import triton_compile_table as tct
    finally:
        sys.path.pop(0)
    row = {
        "kernel": "k",
        "d_model": 2048,
        "dtype": "bf16",
        "doc_mask": True,
        "spill_store_bytes": 4,
        "spill_load_bytes": 0,
        "shared_bytes": 0,
    }
    assert tct.problems([row]) and "spills 4 B" in tct.problems([row])[0]
    assert tct.problems([{**row, "spill_store_bytes": 0, "shared_bytes": 300000}])[0].endswith("> 232448")
    assert tct.problems([{**row, "spill_store_bytes": 0}]) == []
