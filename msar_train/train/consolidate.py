"""Any training checkpoint -> the single-process ``Transformer``'s state dict.

DeepSpeed writes a checkpoint in the shape of the layout that trained it (``train/checkpoint.py``):

    layout                     module weights                                   routed experts
    plain, ZeRO-1/2            mp_rank_00_model_states.pt["module"]            -
    pipeline, no MoE on stage  layer_XX-model_states.pt (XX = global layer)     -
    pipeline, MoE on stage s   mp_rank_{s:02d}_model_states.pt["module"]        (in the expert files)
    expert parallel            mp_rank_{s:02d}["module"] without experts        layer_{m}_expert_{e}_mp_rank_{s:02d}_model_states.pt

Names: a plain model's names are already the single-process names; a pipeline names its layers by
global index (``"3.attn.wq.weight"`` = ``blocks.2.attn.wq.weight``, 0 = ``embed``, n_layers + 1 =
``head``), the same for every ``virtual_stages``. Expert files hold ``<module
path>.deepspeed_moe.experts.deepspeed_experts.<global expert>.<param>`` (DeepSpeed renumbers local
experts to global ones when it saves), i.e. ``<module path>.experts.<global expert>.<param>``. In an
expert file name ``m`` is the MoE layer's index among the MoE layers of the stage's module (in module
order, which is ascending global layer order for every layout here) and ``e`` the global expert.

``consolidate`` reads every file, maps every name, checks that the result has exactly the keys of the
single-process model (a missing file is named: a missing EP rank leaves a hole of experts whose file
names are known), that replicas (MSAR's shared source expansions, held by every stage that reads them)
agree, and returns it.

``canonical_name`` / ``stage_layers`` are shared with the layout-changing resume (``train/reshard.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from msar_train.train.checkpoint import CLIENT_KEY, CheckpointError, resolve_model_dir

_EXPERT_RE = re.compile(r"^(?P<mod>.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<e>\d+)\.(?P<rest>.+)$")
_EXPERT_FILE_RE = re.compile(r"^layer_(?P<m>\d+)_expert_(?P<e>\d+)_mp_rank_(?P<s>\d+)_model_states\.pt$")
_LAYER_FILE_RE = re.compile(r"^layer_(?P<idx>\d+)-model_states\.pt$")

__all__ = ["canonical_name", "consolidate", "load_file", "model_states_file", "reference_model", "stage_layers"]


def load_file(path: Path) -> dict:
    """``torch.load`` on the CPU; an unreadable file is a ``CheckpointError`` naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged pickle raises anything from EOFError to RuntimeError
        raise CheckpointError(f"{path.parent}: corrupted checkpoint ({path.name} unreadable: {type(e).__name__}: {e})") from None


def model_states_file(ckpt: Path, stage: int) -> Path:
    return Path(ckpt) / f"mp_rank_{stage:02d}_model_states.pt"


def canonical_name(local: str, n_layers: int, pipelined: bool, expert_offset: int = 0) -> str:
    """A parameter / buffer name of a layout's module -> the single-process ``Transformer`` name.

    ``expert_offset``: the global id of this rank's local expert 0 (``ep_rank * n_routed / ep_size``)
    for names that still carry local expert ids (optimizer state); 0 for expert checkpoint files,
    whose ids DeepSpeed already made global."""
    m = _EXPERT_RE.match(local)
    if m:
        local = f"{m['mod']}.experts.{int(m['e']) + expert_offset}.{m['rest']}"
    if not pipelined:
        return local
    idx, rest = local.split(".", 1)
    i = int(idx)
    if i == 0:
        return f"embed.{rest}"
    if i == n_layers + 1:
        return f"head.{rest}"
    return f"blocks.{i - 1}.{rest}"


def stage_layers(cfg) -> dict[int, list[int]]:
    """Global layer indices (of ``Transformer.layers()``) held by each pipeline stage, ascending."""
    from msar_train.parallel.partition import partition

    p = cfg.parallel
    P, V = p.pp_stages, max(1, p.virtual_stages)
    if P == 1:
        return {0: list(range(cfg.model.n_layers + 2))}
    parts = partition(cfg.model, cfg.residual, P * V, p.partition_method)
    out: dict[int, list[int]] = {s: [] for s in range(P)}
    for c in range(P * V):
        out[c % P].extend(range(parts[c], parts[c + 1]))
    return {s: sorted(v) for s, v in out.items()}


def reference_model(cfg, device: str | torch.device = "meta"):
    """The single-process ``Transformer`` of ``cfg`` (on the meta device: names and shapes only)."""
    from msar_train.model.transformer import Transformer

    with torch.device(device):
        return Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=cfg.trainer.seed)


def _client_cfg(ckpt: Path):
    from omegaconf import OmegaConf

    f = model_states_file(ckpt, 0)
    if not f.is_file():
        raise CheckpointError(f"{ckpt}: missing file {f.name} (DeepSpeed model states of stage 0)")
    state = load_file(f)
    if CLIENT_KEY not in state:
        raise CheckpointError(f"{ckpt}: {f.name} has no msar client state (not written by msar-train)")
    return OmegaConf.create(state[CLIENT_KEY]["config"]), state


def _put(out: dict, origin: dict, key: str, value: torch.Tensor, src: str, ckpt: Path) -> None:
    if key in out:
        if not torch.equal(out[key], value):
            raise CheckpointError(f"{ckpt}: corrupted checkpoint ({key} differs between {origin[key]} and {src})")
        return
    out[key] = value
    origin[key] = src


def _expected_expert_file(cfg, block: int, expert: int, layers: dict[int, list[int]]) -> str:
    """The file DeepSpeed writes for expert ``expert`` of block ``block`` (see the module doc)."""
    first = cfg.model.first_k_dense
    pipelined = cfg.parallel.pp_stages > 1
    layer_idx = block + 1  # in Transformer.layers()
    stage = next(s for s, ls in layers.items() if layer_idx in ls)
    moe_blocks = [i - 1 for i in layers[stage] if 1 <= i <= cfg.model.n_layers and i - 1 >= first]
    m = moe_blocks.index(block) if pipelined else block - first
    return f"layer_{m}_expert_{expert}_mp_rank_{stage:02d}_model_states.pt"


def _expected_file(cfg, key: str, layers: dict[int, list[int]], module_stages: set[int]) -> str:
    """Where a missing single-process key should have come from."""
    n = cfg.model.n_layers
    m = re.match(r"^blocks\.(\d+)\.ffn\.experts\.(\d+)\.", key)
    if m and cfg.parallel.ep_size > 1:
        return _expected_expert_file(cfg, int(m[1]), int(m[2]), layers)
    if cfg.parallel.pp_stages == 1:
        return model_states_file(Path("."), 0).name
    head = key.split(".", 1)[0]
    layer_idx = 0 if head == "embed" else n + 1 if head == "head" else int(key.split(".")[1]) + 1
    stage = next(s for s, ls in layers.items() if layer_idx in ls)
    if stage in module_stages:
        return model_states_file(Path("."), stage).name
    return f"layer_{layer_idx:02d}-model_states.pt"


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], object]:
    """``(state_dict of the single-process Transformer, cfg)`` of a training checkpoint of any layout.

    ``path``: a checkpoint directory, a ``checkpoints/`` directory or a run directory (its newest
    valid checkpoint). The checkpoint's manifest is verified first; then every missing piece (a stage's
    model-states file, a pipeline layer file, an expert file of one EP rank) and every unreadable file
    is a ``CheckpointError`` naming the file. Tensors keep the dtype they were saved in (the weights
    the layout evaluated with).
    """
    ckpt = resolve_model_dir(Path(path))
    cfg, first_state = _client_cfg(ckpt)
    p = cfg.parallel
    n = cfg.model.n_layers
    pipelined = p.pp_stages > 1
    layers = stage_layers(cfg)
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    module_stages: set[int] = set()
    for stage in range(p.pp_stages):
        f = model_states_file(ckpt, stage)
        if not f.is_file():
            raise CheckpointError(f"{ckpt}: missing file {f.name} (DeepSpeed model states of pipeline stage {stage})")
        state = first_state if stage == 0 else load_file(f)
        module = state.get("module")
        if module is not None:
            module_stages.add(stage)
            for k, v in module.items():
                _put(out, origin, canonical_name(k, n, pipelined), v, f.name, ckpt)
            continue
        if not pipelined:
            raise CheckpointError(f"{ckpt}: corrupted checkpoint ({f.name} holds no module state)")
        for idx in layers[stage]:
            lf = ckpt / f"layer_{idx:02d}-model_states.pt"
            if not lf.is_file():
                raise CheckpointError(f"{ckpt}: missing file {lf.name} (pipeline layer {idx}, stage {stage})")
            for k, v in load_file(lf).items():
                _put(out, origin, canonical_name(f"{idx}.{k}", n, True), v, lf.name, ckpt)
    for ef in sorted(ckpt.glob("layer_*_expert_*_model_states.pt")):
        m = _EXPERT_FILE_RE.match(ef.name)
        if m is None:
            continue
        for k, v in load_file(ef).items():
            km = _EXPERT_RE.match(k)
            if km is None or int(km["e"]) != int(m["e"]):
                raise CheckpointError(f"{ckpt}: corrupted checkpoint ({ef.name} holds {k}, not expert {m['e']})")
            _put(out, origin, canonical_name(k, n, pipelined), v, ef.name, ckpt)

    ref = reference_model(cfg).state_dict()
    missing = [k for k in ref if k not in out]
    if missing:
        files = sorted({_expected_file(cfg, k, layers, module_stages) for k in missing})
        raise CheckpointError(f"{ckpt}: missing file(s) {', '.join(files)}: {len(missing)} tensors of the model absent (e.g. {missing[0]})")
    unexpected = [k for k in out if k not in ref]
    if unexpected:
        raise CheckpointError(f"{ckpt}: {origin[unexpected[0]]} holds {unexpected[0]}, which the model of its config does not have")
    for k, r in ref.items():
        if tuple(out[k].shape) != tuple(r.shape):
            raise CheckpointError(f"{ckpt}: {origin[k]}: {k} has shape {tuple(out[k].shape)}, the config's model {tuple(r.shape)}")
    return {k: out[k] for k in ref}, cfg
