"""Resume under another layout: a checkpoint of any layout -> the training state of the one logical
model -> the engine of this run's layout.

DeepSpeed's loader only reads a checkpoint into the layout that wrote it (same pipeline cuts, same
ZeRO partitions, same expert shards). When ``trainer.resume`` finds a checkpoint of another layout
(``layout_of`` differs: world size, ``pp_stages``, ``virtual_stages``, ``partition_method``, ``ep_size``,
``zero_stage``, ``dtype``) the trainer goes through this module instead:

``read_state(ckpt)`` -> ``LogicalState``, keyed by the single-process ``Transformer``'s names
(``consolidate.canonical_name``):
    module       every parameter and buffer (router biases included), via ``consolidate``
    master       the fp32 master weight of every parameter: ZeRO's fp32 partitions
                 (``*zero_pp_rank_{d}_mp_rank_{s}_optim_states.pt``) or, without ZeRO, the module itself
    exp_avg / exp_avg_sq / step   AdamW's moments and step count per parameter
    scheduler, counters, client   the LR schedule, DeepSpeed's step counters, the msar client state

Optimizer files by layout (DeepSpeed 0.19):
    ZeRO-1/2      ``optimizer_state_dict``: per param group the flat fp32 partition of DP rank ``d``
                  (``single_partition_of_fp32_groups``), AdamW's state of that flat tensor, and
                  ``param_slice_mappings`` (local name -> (start, numel) in the partition). A group's flat
                  buffer is its parameters in order, cut into equal partitions, so a parameter's fragments
                  in ascending partition order concatenate to the whole parameter. Expert groups are
                  partitioned over the expert-data-parallel group (``d // ep_size``) and hold the local
                  experts of EP rank ``d % ep_size`` (``parallel/expert.py``): ascending ``d`` is again
                  ascending partition order for each expert.
    no ZeRO       a torch ``AdamW.state_dict()`` (parameters by position) in ``mp_rank_{s}_model_states.pt``,
                  or with experts in ``expp_rank_{e}_mp_rank_{s}_optim_states.pt`` per EP rank; the local
                  names of those positions are the client state's ``param_names`` (written by every rank
                  since this module exists; older non-ZeRO checkpoints cannot change layout).
    Parameters replicated on several pipeline stages (MSAR's shared source expansions) must agree.

``apply_state(engine, state)`` writes it into a freshly built engine on every rank: module weights and
buffers, the fp32 master fragments and AdamW state of ZeRO's flat partitions (or the plain optimizer's
per-parameter state), the LR schedule and the engine's step counters. Every rank reads the files it
needs itself (``torch.load(mmap=True)``: only the tensors touched are read).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from msar_train.train.checkpoint import CLIENT_KEY, CheckpointError
from msar_train.train.consolidate import canonical_name, consolidate, model_states_file, reference_model

_ZERO_FILE_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(?P<d>\d+)_mp_rank_(?P<s>\d+)_optim_states\.pt$")
LAYOUT_FIELDS = ("pp_stages", "virtual_stages", "partition_method", "ep_size", "zero_stage", "dtype")
MOMENTS = ("exp_avg", "exp_avg_sq")

__all__ = ["LAYOUT_FIELDS", "LogicalState", "apply_state", "layout_of", "optimizer_param_names", "read_state"]


def layout_of(parallel: dict, world_size: int | None) -> dict[str, Any]:
    """What DeepSpeed's checkpoint files depend on: the world size and the layout fields of ``parallel``."""
    out = {"world_size": world_size}
    for k in LAYOUT_FIELDS:
        v = parallel.get(k)
        out[k] = max(1, int(v or 1)) if k == "virtual_stages" else v
    if int(parallel.get("pp_stages", 1)) == 1:  # partitioning is moot without a pipeline
        out["partition_method"] = None
    return out


def optimizer_param_names(engine) -> list[list[str]] | None:
    """Local parameter names of the plain (non-ZeRO) optimizer, by group and position: what a torch
    ``optimizer.state_dict()`` numbers 0, 1, ...; saved in the client state so a layout change can name
    them. None under ZeRO (its files carry names)."""
    eng = engine.engine
    if eng.zero_optimization() or not hasattr(eng.optimizer, "param_groups") or hasattr(eng.optimizer, "bf16_groups"):
        return None
    names = {id(p): n for n, p in eng.module.named_parameters()}
    if any(id(p) not in names for g in eng.optimizer.param_groups for p in g["params"]):
        return None  # the optimizer steps copies (a mixed-precision wrapper): positions have no module name
    return [[names[id(p)] for p in g["params"]] for g in eng.optimizer.param_groups]


@dataclass
class LogicalState:
    cfg: Any
    module: dict[str, torch.Tensor]
    master: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]  # name -> {exp_avg, exp_avg_sq}
    step: dict[str, float]
    scheduler: dict[str, Any]
    counters: dict[str, int]
    client: dict[str, Any]
    origin: dict[str, str] = field(default_factory=dict)  # name -> file its optimizer state came from


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # a damaged pickle raises anything from EOFError to RuntimeError
        raise CheckpointError(f"{path.parent}: corrupted checkpoint ({path.name} unreadable: {type(e).__name__}: {e})") from None


def _experts_per_rank(cfg) -> int:
    return cfg.model.moe.n_routed // max(1, cfg.parallel.ep_size)


def primary_names(cfg) -> dict[str, str]:
    """Every name of every parameter of the single-process model -> its first name there.

    A module shared by several layers (MSAR's source expansions, read by every later site) has one
    name per layer in a state dict; ``named_parameters`` (and so the optimizer) knows it by the first.
    A pipeline stage that holds a replica knows it by the first layer *on that stage*."""
    ref = reference_model(cfg)
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in ref.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _is_expert(local: str) -> bool:
    return ".deepspeed_moe.experts.deepspeed_experts." in local


def _put_replica(dst: dict, key: str, value, where: str, ckpt: Path, origin: dict) -> None:
    """Replicated parameters (several pipeline stages) must hold the same optimizer state."""
    if key not in dst:
        dst[key] = value
        origin[key] = where
        return
    a, b = dst[key], value
    same = torch.equal(a, b) if torch.is_tensor(a) else all(torch.equal(a[k], b[k]) for k in a)
    if not same:
        raise CheckpointError(f"{ckpt}: corrupted checkpoint (optimizer state of {key} differs between {origin[key]} and {where})")


def _read_zero(ckpt: Path, cfg, files: list[Path], st: LogicalState) -> None:
    n, pipelined, ep, L = cfg.model.n_layers, cfg.parallel.pp_stages > 1, max(1, cfg.parallel.ep_size), _experts_per_rank(cfg)
    primary = primary_names(cfg)
    # (canonical, stage) -> [(d, master, exp_avg, exp_avg_sq, step)]
    frags: dict[tuple[str, int], list] = defaultdict(list)
    for f in files:
        m = _ZERO_FILE_RE.match(f.name)
        d, s = int(m["d"]), int(m["s"])
        osd = _load(f).get("optimizer_state_dict")
        if not isinstance(osd, dict) or "param_slice_mappings" not in osd:
            raise CheckpointError(f"{ckpt}: {f.name} is not a ZeRO-1/2 optimizer file this version can read")
        base = osd["base_optimizer_state"]["state"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            flat = osd["single_partition_of_fp32_groups"][g]
            gst = base.get(g, {})
            step = float(gst["step"]) if "step" in gst else 0.0
            for local, addr in mapping.items():
                offset = (d % ep) * L if _is_expert(local) else 0
                name = canonical_name(local, n, pipelined, expert_offset=offset)
                name = primary.get(name, name)
                sl = slice(addr.start, addr.start + addr.numel)
                mom = {k: (gst[k][sl] if k in gst else torch.zeros(addr.numel)) for k in MOMENTS}
                frags[(name, s)].append((d, flat[sl], mom, step, f.name))
    for (name, _stage), parts in sorted(frags.items(), key=lambda kv: kv[0][1]):
        parts.sort(key=lambda p: p[0])
        shape = st.module[name].shape if name in st.module else None
        if shape is None:
            raise CheckpointError(f"{ckpt}: {parts[0][4]} holds optimizer state of {name}, which the model of its config does not have")
        master = torch.cat([p[1] for p in parts]).view(shape)
        moments = {k: torch.cat([p[2][k] for p in parts]).view(shape) for k in MOMENTS}
        where = parts[0][4]
        _put_replica(st.master, name, master, where, ckpt, st.origin)
        _put_replica(st.moments, name, moments, where, ckpt, {})
        st.step.setdefault(name, parts[0][3])


def _read_plain(ckpt: Path, cfg, st: LogicalState) -> None:
    """Non-ZeRO optimizer states: per stage the mp_rank file, or per EP rank the expp_rank files."""
    n, pipelined, L = cfg.model.n_layers, cfg.parallel.pp_stages > 1, _experts_per_rank(cfg)
    primary = primary_names(cfg)
    for s in range(cfg.parallel.pp_stages):
        model_file = model_states_file(ckpt, s)
        model_state = _load(model_file)
        names = (model_state.get(CLIENT_KEY) or {}).get("param_names")
        if not names:
            raise CheckpointError(
                f"{ckpt}: its non-ZeRO optimizer state has no recorded parameter names (written by an older "
                "version, or by an optimizer that steps copies of the parameters, as bf16 without ZeRO does); "
                "it can only be resumed under the layout that wrote it (parallel.* as in its config)"
            )
        flat_names = [x for g in names for x in g]
        expp = sorted(ckpt.glob(f"expp_rank_*_mp_rank_{s:02d}_optim_states.pt"))
        sources = [(int(f.name.split("_")[2]), f.name, _load(f)["optimizer"]) for f in expp] or [
            (0, model_file.name, model_state["optimizer"])
        ]
        for e, fname, osd in sources:
            if osd is None or "state" not in osd:
                raise CheckpointError(f"{ckpt}: {fname} holds no optimizer state")
            count = sum(len(g["params"]) for g in osd["param_groups"])
            if count != len(flat_names):
                raise CheckpointError(f"{ckpt}: {fname} has {count} optimizer parameters, its recorded names {len(flat_names)}")
            for i, local in enumerate(flat_names):
                name = canonical_name(local, n, pipelined, expert_offset=e * L if _is_expert(local) else 0)
                name = primary.get(name, name)
                if name not in st.module:
                    raise CheckpointError(f"{ckpt}: {fname} holds optimizer state of {name}, which the model of its config does not have")
                pst = osd["state"].get(i, {})
                mom = {k: pst[k] if k in pst else torch.zeros_like(st.module[name], dtype=torch.float32) for k in MOMENTS}
                _put_replica(st.moments, name, mom, fname, ckpt, st.origin)
                st.step.setdefault(name, float(pst["step"]) if "step" in pst else 0.0)
    for name in st.moments:
        st.master[name] = st.module[name].float()


def read_state(ckpt: Path) -> LogicalState:
    """The layout-free training state of a verified checkpoint (see the module doc)."""
    ckpt = Path(ckpt)
    module, cfg = consolidate(ckpt)
    first = _load(model_states_file(ckpt, 0))
    client = first.get(CLIENT_KEY)
    if client is None:
        raise CheckpointError(f"{ckpt}: a DeepSpeed checkpoint without msar training state (not written by msar-train)")
    st = LogicalState(
        cfg=cfg,
        module=module,
        master={},
        moments={},
        step={},
        scheduler=first.get("lr_scheduler") or {},
        counters={k: int(first.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")},
        client=client,
    )
    zero_files = sorted(f for f in ckpt.iterdir() if _ZERO_FILE_RE.match(f.name))
    if zero_files:
        _read_zero(ckpt, cfg, zero_files, st)
    else:
        _read_plain(ckpt, cfg, st)
    params = sorted(set(primary_names(cfg).values()))
    missing = [k for k in params if k not in st.moments]
    if missing:
        raise CheckpointError(f"{ckpt}: optimizer state missing for {len(missing)} parameters (e.g. {missing[0]})")
    return st


# ------------------------------------------------------------------------------------- apply
def _local_to_canonical(engine) -> Callable[[str], str]:
    cfg = engine.cfg
    offset = engine.ep_rank * _experts_per_rank(cfg)
    primary = primary_names(cfg)

    def f(local: str) -> str:
        name = canonical_name(local, cfg.model.n_layers, engine.pipelined, expert_offset=offset if _is_expert(local) else 0)
        return primary.get(name, name)

    return f


def _group_step(names: list[str], st: LogicalState) -> float:
    steps = {st.step[n] for n in names}
    if len(steps) != 1:
        raise CheckpointError(f"optimizer step counts differ inside one parameter group of this layout: {sorted(steps)}")
    return steps.pop()


def apply_state(engine, st: LogicalState) -> None:
    """Write ``st`` into ``engine`` (``parallel.engine.Engine``, freshly built, before any step). Every
    rank calls it; no collective."""
    eng = engine.engine
    canon = _local_to_canonical(engine)
    module = eng.module
    local_sd = module.state_dict()
    with torch.no_grad():
        module.load_state_dict({k: st.module[canon(k)].to(v.dtype) for k, v in local_sd.items()}, strict=True)
    names = {id(p): n for n, p in module.named_parameters()}
    opt = eng.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        base = opt.optimizer
        for i, flat in enumerate(opt.single_partition_of_fp32_groups):
            state = {k: torch.zeros_like(flat) for k in MOMENTS}
            group_names = []
            for p in opt.bit16_groups[i]:
                if p._hp_mapping is None:  # no fragment of p in this rank's partition
                    continue
                name = canon(names[id(p)])
                group_names.append(name)
                hp, lp = p._hp_mapping.hp_fragment_address, p._hp_mapping.lp_fragment_address
                dst, src = slice(hp.start, hp.start + hp.numel), slice(lp.start, lp.start + lp.numel)
                with torch.no_grad():
                    flat[dst] = st.master[name].flatten()[src].to(flat.dtype)
                for k in MOMENTS:
                    state[k][dst] = st.moments[name][k].flatten()[src]
            if group_names:
                base.state[flat] = {"step": torch.tensor(_group_step(group_names, st)), **state}
    elif hasattr(opt, "state") and hasattr(opt, "param_groups") and not hasattr(opt, "bf16_groups"):  # plain AdamW
        for g in opt.param_groups:
            for p in g["params"]:
                name = canon(names[id(p)])
                opt.state[p] = {
                    "step": torch.tensor(st.step[name]),
                    **{k: st.moments[name][k].to(device=p.device, dtype=p.dtype).clone() for k in MOMENTS},
                }
    else:
        raise CheckpointError(f"resume under another layout: the optimizer {type(opt).__name__} of this layout is not supported")
    _apply_schedule(engine, st)
    for k, v in st.counters.items():
        setattr(eng, k, v)


def _apply_schedule(engine, st: LogicalState) -> None:
    """The LR schedule: one lambda for every group (``parallel/optim.py``), so the saved base rates
    must agree; this layout's groups (possibly more or fewer) all take them."""
    sd = st.scheduler
    sched = engine.scheduler
    if not sd or sched is None:
        return
    bases = set(sd["base_lrs"])
    if len(bases) != 1:
        raise CheckpointError(
            f"resume under another layout: the checkpoint's param groups have different base learning rates {sorted(bases)}"
        )
    base = bases.pop()
    last = sd["_last_lr"][0]
    sched.base_lrs = [base] * len(sched.base_lrs)
    sched.last_epoch = int(sd["last_epoch"])
    sched._step_count = int(sd["_step_count"])
    sched._last_lr = [last] * len(sched.base_lrs)
    for g in engine.optimizer.param_groups:
        g["initial_lr"] = base
        g["lr"] = last
