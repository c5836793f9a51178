#!/usr/bin/env python
"""Data-path throughput on this machine, next to the training throughput it has to feed.

    python scripts/bench_data.py [--corpus shakespeare|ptb] [--model small] [--residual msar]
                                 [--seq 128] [--micro-batch 8] [--num-proc 1 2] [--loader-batches 400]
                                 [--train-steps 4] [--repeats 3] [--json OUT]

Measured in one run:

* tokenization: ``msar-prepare-data``'s encode stage (the corpus' tokenizer already trained, so only
  encoding + shard writing is timed) for each ``--num-proc``, as MB/s of UTF-8 input text and
  tokens/s; BPE training time is reported once.
* loader: ``PackedLoader`` batches/s over the train split (shuffled, rank-sharded, checksummed shards
  opened once), as tokens/s, median of ``--repeats``.
* training: tokens/s of the ``--model`` model trained through the same DeepSpeed ``Engine`` as
  ``msar-train`` (one rank, ``--train-steps`` optimizer steps after one warm-up step).

The loader target of the data issue is >= 50x the training tokens/s; the verdict is printed with the
ratio. A table and the JSON object go to stdout; ``--json OUT`` also writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from msar_train.data.build import ensure_prepared  # noqa: E402
from msar_train.data.corpora import load_builtin  # noqa: E402
from msar_train.data.io import resolve_cache_dir  # noqa: E402
from msar_train.data.loader import PackedLoader  # noqa: E402
from msar_train.data.packed import PackedDataset  # noqa: E402
from msar_train.data.prepare import PrepareConfig, prepare  # noqa: E402

LOADER_TARGET = 50.0


def bench_tokenization(corpus: str, prepared: Path, cache: Path, num_procs: list[int]) -> list[dict]:
    docs = load_builtin(corpus, cache)
    n_bytes = sum(len(d.encode("utf-8")) for split in docs.values() for d in split)
    rows = []
    for n in num_procs:
        with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
            cfg = PrepareConfig(
                corpus=corpus, out_dir=tmp, tokenizer=str(prepared / "tokenizer.json"), num_proc=n,
                cache_dir=str(cache), progress=False,
            )  # fmt: skip
            meta = prepare(cfg)
        s = meta["stats"]["encode_s"]
        tokens = sum(v["num_tokens"] for v in meta["splits"].values())
        rows.append({"num_proc": n, "input_mb": n_bytes / 1e6, "encode_s": s, "mb_per_s": n_bytes / 1e6 / s, "tokens_per_s": tokens / s})
    return rows


def bench_loader(prepared: Path, seq: int, micro_batch: int, n_batches: int, repeats: int) -> dict:
    t0 = time.perf_counter()
    ds = PackedDataset(prepared, "train", verify_checksums=True)
    open_s = time.perf_counter() - t0
    rates = []
    for r in range(repeats):
        loader = PackedLoader(ds, seq_len=seq, micro_batch_size=micro_batch, seed=r, shuffle=True)
        t = time.perf_counter()
        tokens = 0
        for _ in range(n_batches):
            tokens += next(loader).input_ids_BT.numel()
        rates.append(tokens / (time.perf_counter() - t))
    return {
        "open_s": open_s,
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
    }


def bench_training(model: str, residual: str, corpus: str, seq: int, micro_batch: int, steps: int) -> dict:
    from msar_train.config import compose_config
    from msar_train.data import build_data
    from msar_train.parallel.engine import Engine

    cfg = compose_config(
        [f"model={model}", f"residual={residual}", f"data.corpus={corpus}", f"data.seq_len={seq}",
         f"data.tokenizer_vocab_size={4096}", f"parallel.micro_batch_size={micro_batch}", "parallel.grad_accum=1"]
    )  # fmt: skip
    engine = Engine(cfg)
    data = build_data(cfg.data, model_vocab_size=cfg.model.vocab_size, seed=0, micro_batch_size=micro_batch)
    it = iter(data.train)
    engine.train_step([next(it)])  # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.train_step([next(it)])
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"model": model, "residual": residual, "step_s_median": med, "tokens_per_s": seq * micro_batch / med}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="shakespeare", choices=["shakespeare", "ptb"])
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocab of the prepared corpus")
    ap.add_argument("--model", default="small")
    ap.add_argument("--residual", default="msar")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--loader-batches", type=int, default=400)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if min(args.num_proc) < 1 or args.loader_batches < 1 or args.train_steps < 1 or args.repeats < 1:
        ap.error("--num-proc, --loader-batches, --train-steps and --repeats must be >= 1")

    cache = resolve_cache_dir(None)
    t = time.perf_counter()
    prepared = ensure_prepared(args.corpus, args.vocab, cache, progress=False)
    prepare_s = time.perf_counter() - t
    meta = json.loads((prepared / "meta.json").read_text())
    tok = bench_tokenization(args.corpus, prepared, cache, args.num_proc)
    loader = bench_loader(prepared, args.seq, args.micro_batch, args.loader_batches, args.repeats)
    train = bench_training(args.model, args.residual, args.corpus, args.seq, args.micro_batch, args.train_steps)
    ratio = loader["tokens_per_s_median"] / train["tokens_per_s"]
    out = {
        "corpus": args.corpus,
        "cpu_count": os.cpu_count(),
        "bpe_train_s": meta["stats"]["tokenizer_train_s"],
        "prepare_cached_s": prepare_s,
        "tokenization": tok,
        "loader": {"seq_len": args.seq, "micro_batch": args.micro_batch, **loader},
        "training": train,
        "loader_over_training": ratio,
        "loader_target": LOADER_TARGET,
        "target_met": ratio >= LOADER_TARGET,
    }
    print("| stage | setting | throughput |")
    print("|---|---|---|")
    print(f"| BPE training | vocab {args.vocab}, {args.corpus} | {out['bpe_train_s']:.1f} s (when first prepared) |")
    for r in tok:
        speed = f"{r['mb_per_s']:.2f} MB/s, {r['tokens_per_s']:,.0f} tokens/s"
        print(f"| tokenization | num_proc={r['num_proc']}, {r['input_mb']:.1f} MB | {speed} |")
    lo = loader
    print(
        f"| loader | seq {args.seq} x batch {args.micro_batch} | {lo['tokens_per_s_median']:,.0f} tokens/s "
        f"(min {lo['tokens_per_s_min']:,.0f}, max {lo['tokens_per_s_max']:,.0f}) |"
    )
    print(f"| training | model={args.model} residual={args.residual} | {train['tokens_per_s']:,.0f} tokens/s |")
    verdict = "met" if out["target_met"] else "NOT met"
    print(f"\nloader / training = {ratio:,.0f}x (target >= {LOADER_TARGET:.0f}x: {verdict})\n")
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
