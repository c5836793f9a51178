"""Multi-rank worker for tests/distributed/test_interleaved.py (run under torchrun, never collected).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/_interleaved_worker.py {parity|checkpoint} OUT_DIR

P = 2 pipeline ranks, V = 2 chunks each (C = 4). Each rank writes ``OUT_DIR/{mode}_rank{r}.json``; the test
asserts on it. The reference is the single-process ``Transformer`` built from the same config and seed
(per-layer deterministic init), run on the same micro-batches in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from msar_train.config import compose_config
from msar_train.data.loader import Batch
from msar_train.model.transformer import Transformer, lm_loss
from msar_train.parallel.comm import comm_plan
from msar_train.parallel.engine import Engine

B, T, M = 2, 16, 4  # micro-batch, sequence, micro-batches per step (M = 2P: a real 1F1B steady state)
# (residual, summary_cache, document_mask)
CASES = [("msar", True, False), ("msar", False, False), ("attnres", True, False), ("attnres", False, False), ("msar", True, True)]


def config(residual: str, cache: bool, document_mask: bool = False, virtual_stages: int = 2):
    return compose_config(
        [
            "model=tiny",
            f"residual={residual}",
            "parallel=pp2",
            f"parallel.virtual_stages={virtual_stages}",
            f"parallel.summary_cache={str(cache).lower()}",
            f"parallel.micro_batch_size={B}",
            f"parallel.grad_accum={M}",
            f"data.seq_len={T}",
            f"data.document_mask={str(document_mask).lower()}",
            "logger.mode=disabled",
        ]
    )


def batches(cfg, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(M):
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
        doc = pos = None
        if cfg.data.document_mask:  # two documents per row, split at a random point
            cut = torch.randint(1, T, (B, 1), generator=g)
            t = torch.arange(T).expand(B, T)
            doc = (t >= cut).long()
            pos = torch.where(t >= cut, t - cut, t)
        out.append(Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), doc, pos))
    return out


def reference(cfg, bs: list[Batch]) -> tuple[float, Transformer]:
    ref = Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=cfg.trainer.seed)
    total = 0.0
    for b in bs:
        args = (b.input_ids_BT, b.doc_ids_BT, b.positions_BT) if cfg.data.document_mask else (b.input_ids_BT,)
        loss, _ = lm_loss(ref(*args), b.labels_BT)
        (loss / len(bs)).backward()
        total += float(loss) / len(bs)
    return total, ref


def capture_grads(engine: Engine) -> dict[str, torch.Tensor]:
    """Gradients as they enter the data-parallel reduction (after the shared-module all-reduce)."""
    store: dict[str, torch.Tensor] = {}
    eng = engine.engine
    orig = eng.allreduce_gradients

    def wrapped(*a, **k):
        store.clear()
        store.update({n: p.grad.detach().clone() for n, p in eng.module.named_parameters() if p.grad is not None})
        return orig(*a, **k)

    eng.allreduce_gradients = wrapped
    return store


def parity(out: Path) -> dict:
    res = {}
    for residual, cache, docmask in CASES:
        cfg = config(residual, cache, docmask)
        engine = Engine(cfg)
        grads = capture_grads(engine)
        bs = batches(cfg, seed=7)
        r = engine.train_step(bs)
        ref_loss, ref = reference(cfg, bs)
        ref_layers = ref.layers()
        missing, pairs = [], []
        for name, _p in engine.engine.module.named_parameters():
            idx, rest = name.split(".", 1)
            gr = ref_layers[int(idx)].get_parameter(rest).grad
            g = grads.get(name)
            if (g is None) != (gr is None):
                missing.append(name)
            elif g is not None:
                pairs.append((name, g, gr))
        # Per tensor, relative to its own largest entry, floored at 1e-3 of the stage's largest entry:
        # some gradients (e.g. MSAR fusion scales, sums of cancelling terms) are 1e4 times smaller than
        # the rest, and fp32 rounding in another summation order is large relative to them alone.
        ref_max = max(float(gr.abs().max()) for _, _, gr in pairs)
        worst, worst_name = 0.0, ""
        for name, g, gr in pairs:
            e = float((g - gr).abs().max()) / max(float(gr.abs().max()), 1e-3 * ref_max)
            if e > worst:
                worst, worst_name = e, name
        diff_sq = sum(float((g - gr).double().square().sum()) for _, g, gr in pairs)
        ref_sq = sum(float(gr.double().square().sum()) for _, _, gr in pairs)
        eng = engine.engine
        plan = comm_plan(cfg)
        key = f"{residual}_{'cache' if cache else 'nocache'}{'_docmask' if docmask else ''}"
        res[key] = {
            "loss_rel": abs(r.loss - ref_loss) / abs(ref_loss),
            "grad_rel": worst,
            "grad_rel_worst": worst_name,
            "grad_global_rel": (diff_sq / ref_sq) ** 0.5 if ref_sq else None,
            "grad_presence_mismatch": missing,
            "n_grads": len(grads),
            "n_local_params": sum(1 for _ in eng.module.parameters()),
            "bytes": eng.comm_bytes_last_step,
            "step_result_bytes": r.comm_bytes,
            "plan_cached": plan["comm_bytes_cached"],
            "plan_naive": plan["comm_bytes_naive"],
            "cache_after_step": len(eng.cache),
            "cache_peak": eng.cache_peak_entries,
            "chunks": eng.module.chunk_ids,
        }
        # A second step and an evaluation must leave the cache empty too.
        engine.train_step(batches(cfg, seed=8))
        res[key]["cache_after_step2"] = len(eng.cache)
        engine.eval_loss(batches(cfg, seed=9)[:3])  # M=3: evaluation needs no multiple of P
        res[key]["cache_after_eval"] = len(eng.cache)
    return res


def checkpoint(out: Path) -> dict:
    cfg = config("msar", True)
    ckpt = out / "ckpt"
    a = Engine(cfg)
    a.train_step(batches(cfg, seed=1))
    a.save(ckpt, "s1", {"step": 1})
    torch.manual_seed(123)
    la = a.train_step(batches(cfg, seed=2)).loss
    pa = {n: p.detach().clone() for n, p in a.engine.module.named_parameters()}
    b = Engine(cfg)
    client = b.load(ckpt, "s1")
    torch.manual_seed(123)
    lb = b.train_step(batches(cfg, seed=2)).loss
    pb = {n: p.detach() for n, p in b.engine.module.named_parameters()}
    return {
        "client_step": client.get("step"),
        "loss_a": la,
        "loss_b": lb,
        "param_max_diff": max(float((pa[n] - pb[n]).abs().max()) for n in pa),
        "layer_files": sorted(p.name for p in (ckpt / "s1").glob("layer_*")),
    }


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    import deepspeed.comm as dist

    res = {"parity": parity, "checkpoint": checkpoint}[mode](out)
    rank = dist.get_rank()
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(res))
    from msar_train.parallel.engine import shutdown_distributed

    shutdown_distributed()  # not left to the interpreter's exit (see its docstring)


if __name__ == "__main__":
    main()
