"""Decode speed: cached (``Transformer.decode`` + ``DecodeCache``) against uncached greedy decoding.

For each model preset, residual preset and prompt length: a random prompt, then ``--new`` greedy
tokens, (a) uncached: every token a full forward over the prefix; (b) cached: one prefill forward, then
one incremental forward per token. Reported per token (the prefill excluded): the median over the
new tokens of the per-token wall time, as ms/token and tokens/s, median over ``--repeats`` rounds
(cached and uncached alternate inside a round, so a busy machine slows both alike). The two paths must
choose the same tokens (checked; the row says so).

Cached per-token cost should not grow with the prompt beyond the attention's key/value read: the
``growth`` column divides each row's cached ms/token by the same model's at the shortest prompt, and
``--residuals msar,vanilla`` puts MSAR's growth next to vanilla's (whose only length-dependent cost is
that read).

Weights are the seeded initialisation (speed does not depend on training); ``model.max_seq_len`` is
raised to fit the longest prompt plus the new tokens (RoPE has no trained length limit to respect here).

    .venv/bin/python scripts/bench_decode.py                       # tiny + small, prompts 64/256/1024
    .venv/bin/python scripts/bench_decode.py --models tiny --prompts 64,256 --new 8 --repeats 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msar_train.config import compose_config  # noqa: E402
from msar_train.model.cache import DecodeCache  # noqa: E402
from msar_train.model.transformer import Transformer  # noqa: E402


def build(model: str, residual: str, max_len: int) -> Transformer:
    cfg = compose_config([f"model={model}", f"residual={residual}", f"model.max_seq_len={max_len}", f"data.seq_len={min(max_len, 256)}"])
    return Transformer(cfg.model, cfg.residual, seed=0).eval()


@torch.no_grad()
def uncached(model: Transformer, prompt_BT: torch.Tensor, new: int) -> tuple[list[float], list[int]]:
    seq, times, toks = prompt_BT, [], []
    for _ in range(new):
        t0 = time.perf_counter()
        nxt = model(seq)[0][:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
        seq = torch.cat([seq, nxt], 1)
        toks.append(int(nxt))
    return times, toks


@torch.no_grad()
def cached(model: Transformer, prompt_BT: torch.Tensor, new: int) -> tuple[list[float], list[int], float, int]:
    """(per-token times, tokens, prefill seconds, cache bytes at the end)."""
    cache = DecodeCache()
    t0 = time.perf_counter()
    nxt = model.decode(prompt_BT, cache)[0][:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - t0
    times, toks = [], [int(nxt)]
    for _ in range(new - 1):
        t0 = time.perf_counter()
        nxt = model.decode(nxt, cache)[0][:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
        toks.append(int(nxt))
    return times, toks, prefill, cache.nbytes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--residuals", default="msar,vanilla")
    ap.add_argument("--prompts", default="64,256,1024")
    ap.add_argument("--new", type=int, default=16, help="new tokens per decode (default 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [int(p) for p in args.prompts.split(",")]
    if args.new < 2 or args.repeats < 1 or min(prompts) < 1:
        ap.error("--new must be >= 2, --repeats >= 1, prompt lengths >= 1")
    max_len = max(prompts) + args.new
    print(f"# scripts/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={torch.get_num_threads()}, fp32, batch 1, "
        f"{args.new} new tokens, median of {args.repeats} rounds of the per-token median"
    )
    cols = ["model", "residual", "prompt", "uncached ms/token", "cached ms/token", "speedup", "cached tokens/s"]
    cols += ["growth vs shortest", "prefill s", "cache MiB", "same tokens"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for model_name in args.models.split(","):
        for residual in args.residuals.split(","):
            model = build(model_name, residual, max_len)
            g = torch.Generator().manual_seed(0)
            base = None
            for T in prompts:
                prompt = torch.randint(0, model.cfg.vocab_size, (1, T), generator=g)
                cached(model, prompt[:, : min(T, 8)], 3)  # warm-up
                u_med, c_med, prefills, same = [], [], [], True
                for _ in range(args.repeats):
                    ut, utoks = uncached(model, prompt, args.new)
                    ct, ctoks, pre, nbytes = cached(model, prompt, args.new)
                    u_med.append(statistics.median(ut[1:]))  # token 1 of uncached = the prefill
                    c_med.append(statistics.median(ct))
                    prefills.append(pre)
                    same &= utoks == ctoks
                u, c = statistics.median(u_med), statistics.median(c_med)
                base = c if base is None else base
                print(
                    f"| {model_name} | {residual} | {T} | {1e3 * u:.2f} | {1e3 * c:.2f} | {u / c:.1f}x | {1 / c:.0f} | {c / base:.2f} | "
                    f"{statistics.median(prefills):.3f} | {nbytes / 2**20:.2f} | {'yes' if same else 'NO'} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
