"""Compile every depth-attention Triton kernel for a real GPU on this machine and report its resources.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` lowers each kernel
to PTX for sm_90 (H100/H200) and the ptxas that ships with the triton wheel assembles it with ``-v``,
which prints the registers per thread, the stack frame and the spill stores/loads. Each kernel is
compiled at the launch configuration ``msar_train.kernels.triton_depth.launch_config`` picks for each
width (and the launcher's register cap ``MAX_REGISTERS``), in fp32 and bf16 activations, with and
without document masking, with the 16-divisibility hints a real launch gives the pointers and the D
and T arguments (the widths below are multiples of 16).

    python scripts/triton_compile_table.py                      # markdown table on stdout
    python scripts/triton_compile_table.py --json out.json      # and the rows as JSON
    python scripts/triton_compile_table.py --widths 384 7168 --dtypes bf16

Exit status 1 when any kernel spills registers or needs more shared memory than an sm_90 block may use.
Run it without TRITON_INTERPRET (the interpreter has no compiler); the script removes it from its own
environment before triton is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTHS = (384, 2048, 2560, 4096, 7168)
DTYPES = {"fp32": "fp32", "bf16": "bf16"}
SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
KERNELS = ("_p1_fwd", "_p1_stats", "_p1_dE", "_conv_ds", "_conv_dw", "_p2_fwd", "_p2_bwd")
# Pointer arguments that carry activations (the source, phase 2's output, its incoming gradient and
# the source gradient) take the activation dtype; every other pointer is fp32 scratch or weights.
ACTIVATION_PTRS = {"src_ptr", "ds_ptr"}
ACTIVATION_PTRS_P2 = {"z_ptr", "dz_ptr"}
INT_PTRS = {"ks_ptr", "doc_ptr"}
FLOAT_SCALARS = {"eps"}
HINTED_INTS = {"D", "T"}


def _signature(fn, dtype: str) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ("HAS_DOC", "BLOCK_T", "BLOCK_D"):
            sig[name] = "constexpr"
        elif name in INT_PTRS:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            act = name in ACTIVATION_PTRS or (fn.__name__.startswith("_p2") and name in ACTIVATION_PTRS_P2)
            sig[name] = f"*{dtype}" if act else "*fp32"
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name.endswith("_ptr") or name in HINTED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _ptxas_report(ptx: str, ptxas: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", str(path), "-o", str(Path(d) / "k.cubin")], capture_output=True, text=True
        )
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed: {text.strip()}")
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or spill is None:
        raise RuntimeError(f"cannot read ptxas -v output: {text.strip()}")
    return {
        "registers": int(regs.group(1)),
        "stack_bytes": int(spill.group(1)),
        "spill_store_bytes": int(spill.group(2)),
        "spill_load_bytes": int(spill.group(3)),
    }


def compile_rows(widths, dtypes, docs=(False, True)) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from msar_train.kernels import triton_depth as td

    ptxas = get_ptxas(90).path
    target = GPUTarget("cuda", 90, 32)
    cache: dict[tuple, dict] = {}
    rows = []
    for D in widths:
        bt, bd, nw = td.launch_config(D)
        for dtype in dtypes:
            for has_doc in docs:
                for name in KERNELS:
                    key = (name, dtype, has_doc, bt, bd, nw)
                    if key not in cache:
                        fn = getattr(td, name)
                        sig, attrs = _signature(fn, DTYPES[dtype])
                        t0 = time.perf_counter()
                        src = ASTSource(fn=fn, signature=sig, constexprs={"HAS_DOC": has_doc, "BLOCK_T": bt, "BLOCK_D": bd}, attrs=attrs)
                        k = triton.compile(src, target=target, options={"num_warps": nw, "maxnreg": td.MAX_REGISTERS})
                        cache[key] = {**_ptxas_report(k.asm["ptx"], ptxas), "shared_bytes": int(k.metadata.shared)}
                        cache[key]["compile_s"] = round(time.perf_counter() - t0, 2)
                    rep = cache[key]
                    rows.append(
                        {
                            "kernel": name,
                            "d_model": D,
                            "dtype": dtype,
                            "doc_mask": has_doc,
                            "BLOCK_T": bt,
                            "BLOCK_D": bd,
                            "num_warps": nw,
                            **rep,
                        }
                    )
    return rows


def problems(rows: list[dict]) -> list[str]:
    bad = []
    for r in rows:
        tag = f"{r['kernel']} d_model={r['d_model']} {r['dtype']} doc_mask={r['doc_mask']}"
        if r["spill_store_bytes"] or r["spill_load_bytes"]:
            bad.append(f"{tag}: spills {r['spill_store_bytes']} B stores / {r['spill_load_bytes']} B loads")
        if r["shared_bytes"] > SM90_SHARED_LIMIT:
            bad.append(f"{tag}: {r['shared_bytes']} B shared memory > {SM90_SHARED_LIMIT}")
    return bad


def markdown(rows: list[dict]) -> str:
    lines = [
        "| kernel | d_model | dtype | doc mask | BLOCK_T x BLOCK_D, warps | registers | spill st/ld (B) | stack (B) | shared (B) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['d_model']} | {r['dtype']} | {'yes' if r['doc_mask'] else 'no'} | "
            f"{r['BLOCK_T']} x {r['BLOCK_D']}, {r['num_warps']} | {r['registers']} | "
            f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['stack_bytes']} | {r['shared_bytes']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="d_model values (default: %(default)s)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if any(w <= 0 for w in args.widths):
        ap.error(f"--widths: every d_model must be positive, got {args.widths}")
    t0 = time.perf_counter()
    rows = compile_rows(args.widths, args.dtypes)
    print(markdown(rows))
    bad = problems(rows)
    compiles = len({(r["kernel"], r["dtype"], r["doc_mask"], r["BLOCK_T"], r["BLOCK_D"]) for r in rows})
    print(f"\n{len(rows)} kernel x width x dtype x mask rows, {compiles} compiles, {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"target": "sm_90a (ptxas -v)", "rows": rows, "problems": bad}, indent=1))
    for b in bad:
        print(f"PROBLEM: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported (compile_rows imports it)
    sys.exit(main())
