"""Multi-rank worker for tests/distributed/test_expert_parallel.py (run under torchrun, never collected).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/_ep_worker.py {parity|deepspeed} OUT_DIR

Each rank writes ``OUT_DIR/{mode}_rank{r}.json``: ``{case: {metric: max abs error or value}}``; the test
asserts on them. The reference is always the single-process ``MoE`` built with the same seed.

Legend: W = world size (= ep_size here), B/T/D as in the model, E routed experts.
"""

from __future__ import annotations

import datetime
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from msar_train.config.schema import MoEConfig
from msar_train.model.moe import MoE

D, T = 16, 5
TIMEOUT = datetime.timedelta(seconds=60)

# name -> (MoEConfig kwargs, tokens per rank as B rows of T, setup)
PARITY_CASES: dict[str, dict] = {
    "softmax_grouped": {
        "cfg": {
            "n_routed": 8,
            "n_shared": 1,
            "top_k": 2,
            "expert_hidden": 12,
            "score_func": "softmax",
            "n_group": 4,
            "topk_group": 2,
            "aux_loss_coef": 0.01,
            "seq_aux_loss_coef": 0.02,
        },
        "batch": [3, 2],
    },
    "sigmoid_grouped": {
        "cfg": {
            "n_routed": 8,
            "n_shared": 2,
            "top_k": 3,
            "expert_hidden": 12,
            "score_func": "sigmoid",
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "aux_loss_coef": 0.01,
            "seq_aux_loss_coef": 0.02,
        },
        "batch": [2, 4],
    },
    # Rank 0's tokens only reach experts 0-3 (rank 0): it sends nothing to rank 1; experts 3 and 7 get
    # no token at all (one local expert per rank runs on zero rows).
    "uneven": {
        "cfg": {
            "n_routed": 8,
            "n_shared": 1,
            "top_k": 2,
            "expert_hidden": 12,
            "score_func": "softmax",
            "n_group": 2,
            "topk_group": 1,
            "aux_loss_coef": 0.01,
        },
        "batch": [3, 3],
        "skew": True,
    },
    # Rank 1 has no tokens at all (aux losses off: a balance loss over zero tokens is undefined).
    "empty_rank": {
        "cfg": {"n_routed": 4, "n_shared": 0, "top_k": 2, "expert_hidden": 8, "score_func": "sigmoid"},
        "batch": [2, 0],
    },
}


def _inputs(seed: int, batch: list[int], skew: bool) -> list[torch.Tensor]:
    xs = []
    for r, b in enumerate(batch):
        g = torch.Generator().manual_seed(1000 * seed + r)
        x = torch.randn(b, T, D, generator=g)
        if skew and r == 0:
            x[..., 0] = x[..., 0].abs() + 3.0  # strongly positive along the direction experts 0-3 favour
        xs.append(x)
    return xs


def _build(cfg_kw: dict, seed: int, skew: bool) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(MoEConfig(**cfg_kw), D)
    if skew:
        with torch.no_grad():
            moe.router.weight[:4, 0] += 4.0
            moe.router.weight[4:, 0] -= 4.0
            moe.router.expert_bias[3] = -10.0
            moe.router.expert_bias[7] = -10.0
    return moe


def _maxdiff(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor) -> float:
    a = torch.zeros_like(like) if a is None else a
    b = torch.zeros_like(like) if b is None else b
    return float((a - b).abs().max()) if a.numel() else 0.0


def run_parity(out_dir: Path) -> None:
    from msar_train.parallel.expert import expert_name_map, shard_experts

    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_group = dist.new_group(list(range(world)), timeout=TIMEOUT)
    results: dict[str, dict] = {}
    for seed, (case, spec) in enumerate(PARITY_CASES.items()):
        skew = spec.get("skew", False)
        xs = _inputs(seed, spec["batch"], skew)
        gs = [torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + 100 * seed + r)) for r, x in enumerate(xs)]

        # Single-process reference on the concatenation; aux loss = sum of the per-rank-token aux losses.
        ref = _build(spec["cfg"], seed, skew)
        x_ref = torch.cat(xs).requires_grad_()
        y_ref, _ = ref(x_ref)
        aux_ref = [ref.router(xr.reshape(-1, D), seq_len=T).aux_loss for xr in x_ref.split(spec["batch"])]
        ((y_ref * torch.cat(gs)).sum() + sum(aux_ref)).backward()
        ref_counts_r = torch.bincount(ref.router(xs[rank].reshape(-1, D), seq_len=T).idx_NK.reshape(-1), minlength=ref.cfg.n_routed)

        moe = _build(spec["cfg"], seed, skew)
        shard_experts(moe, ep_group, rank, world)
        moe.train()
        x = xs[rank].clone().requires_grad_()
        y, aux = moe(x)
        ((y * gs[rank]).sum() + aux).backward()

        lo = sum(spec["batch"][:rank])
        sl = slice(lo, lo + spec["batch"][rank])
        res = {
            "out": _maxdiff(y.detach(), y_ref.detach()[sl], y),
            "aux": abs(float(aux.detach()) - float(aux_ref[rank].detach())),
            "x_grad": _maxdiff(x.grad, x_ref.grad[sl], x),
        }
        # Replicated params: the data-parallel all-reduce (sum) of the per-rank grads = reference grad.
        ref_params = dict(ref.named_parameters())
        rep = 0.0
        for name, p in moe.named_parameters():
            if name.startswith("deepspeed_moe."):
                continue
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g)
            rep = max(rep, _maxdiff(g, ref_params[name].grad, p))
        res["replicated_grad"] = rep
        # Expert params: held by one rank each (ep_size == world), so the expert-data-parallel sum is the
        # local grad itself; compare under the single-process name.
        ep_params = dict(moe.named_parameters())
        res["expert_grad"] = max(
            _maxdiff(ep_params[n].grad, ref_params[ref_n].grad, ep_params[n]) for n, ref_n in expert_name_map(moe).items()
        )
        res["expert_names"] = sorted(expert_name_map(moe).values())
        res["load_counts"] = _maxdiff(moe.load_counts, ref_counts_r.float(), moe.load_counts)
        res["load_counts_list"] = moe.load_counts.tolist()

        # Aux-loss-free bias update: all-reduced counts give the same bias on every rank as the reference.
        counts = moe.consume_load()
        dist.all_reduce(counts)
        moe.apply_bias_update(counts)
        ref.apply_bias_update(torch.bincount(ref.router(x_ref.reshape(-1, D)).idx_NK.reshape(-1), minlength=ref.cfg.n_routed))
        res["bias"] = _maxdiff(moe.router.expert_bias, ref.router.expert_bias, ref.router.expert_bias)
        results[case] = res
    (out_dir / f"parity_rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


class _Net(nn.Module):
    """Dense layer -> MoE -> dense head: dense, router, shared and expert params all get gradients."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(cfg, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        y_BTD, aux = self.moe(self.inp(x_BTD))
        return self.head(y_BTD).square().mean() + aux


DS_CFG = {
    "n_routed": 8,
    "n_shared": 1,
    "top_k": 2,
    "expert_hidden": 12,
    "score_func": "sigmoid",
    "n_group": 2,
    "topk_group": 1,
    "aux_loss_coef": 0.01,
}
LR, STEPS = 0.1, 2


def _ds_batches(world: int) -> list[list[torch.Tensor]]:
    return [[torch.randn(2, T, D, generator=torch.Generator().manual_seed(100 * s + r)) for r in range(world)] for s in range(STEPS)]


def run_deepspeed(out_dir: Path) -> None:
    # Skip DeepSpeed's JIT build of the CPU shm op (see /work/shared/notes/deepspeed-cpu.md).
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split_moe

    from msar_train.parallel.expert import expert_groups_from_deepspeed, expert_name_map, shard_model_experts

    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    eg = expert_groups_from_deepspeed(world)
    batches = _ds_batches(world)

    # Reference: the data-parallel mean of the per-rank losses, plain SGD, one process.
    torch.manual_seed(0)
    ref = _Net(MoEConfig(**DS_CFG))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for xs in batches:
        ref_opt.zero_grad()
        (sum(ref(x) for x in xs) / world).backward()
        ref_opt.step()
    ref_params = dict(ref.named_parameters())

    def make_engine(stage: int):
        torch.manual_seed(0)
        net = _Net(MoEConfig(**DS_CFG))
        shard_model_experts(net, eg.ep_group, eg.ep_rank, eg.ep_size)
        groups = split_moe({"params": list(net.parameters()), "name": "params"})
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(groups, lr=LR), config=cfg)
        return engine, net

    def param_err(net: nn.Module) -> tuple[float, float]:
        names = expert_name_map(net.moe, prefix="moe.")
        dense = expert = 0.0
        for n, p in net.named_parameters():
            if n in names:
                expert = max(expert, _maxdiff(p.detach(), ref_params[names[n]].detach(), p))
            else:
                dense = max(dense, _maxdiff(p.detach(), ref_params[n].detach(), p))
        return dense, expert

    results: dict[str, dict] = {}
    ckpt_dir = out_dir / "ckpt"
    for stage in (0, 1, 2):
        engine, net = make_engine(stage)
        for xs in batches:
            loss = engine(xs[rank])
            engine.backward(loss)
            engine.step()
        dense, expert = param_err(net)
        res = {
            "has_moe_layers": bool(engine.has_moe_layers),
            "dense_param": dense,
            "expert_param": expert,
            "moe_groups": sum(bool(g.get("moe")) for g in engine.optimizer.param_groups),
        }
        if stage == 1:
            tag = "s1"
            engine.save_checkpoint(str(ckpt_dir), tag=tag)
            fresh, fresh_net = make_engine(stage)
            # Trained params differ from the fresh init, so reload == 0 proves the experts were loaded.
            res["moved"] = min(_maxdiff(p.detach(), q.detach(), p) for p, q in zip(net.parameters(), fresh_net.parameters()))
            fresh.load_checkpoint(str(ckpt_dir), tag=tag)
            res["reload"] = max(_maxdiff(p.detach(), q.detach(), p) for p, q in zip(net.parameters(), fresh_net.parameters()))
            dist.barrier()
            if rank == 0:
                files = sorted(f.name for f in (ckpt_dir / tag).iterdir())
                res["expert_files"] = [f for f in files if "expert" in f]
                main = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
                res["main_keys"] = sorted(main["module"].keys())
        results[f"zero{stage}"] = res
    (out_dir / f"deepspeed_rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    {"parity": run_parity, "deepspeed": run_deepspeed}[mode](out)
