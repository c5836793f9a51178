"""Training-time diagnostics: residual (depth attention, fusion, mHC) and MoE routing metrics.

Residual metrics come from one recorded no-grad forward (``residual/diagnostics.py``); this module
only reads the recorded keys, never a backend name, so a new backend that records the same keys gets
the same metrics. Indices: ``l`` is the spec's target index (1..L = residual branches, branch
``2*layer + sublayer + 1``; ``L+1`` = the output aggregation), ``r`` the stream, ``j`` the source b_j.

Scalar keys (all floats):
    residual/fusion_weight/layer{l}/stream{r}   mean fusion gate H_r of target l (only when M > 1)
    residual/depth_entropy/layer{l}/stream{r}   per-token entropy of the depth weights / log(#sources)
                                                (1 = uniform; targets with one source are left out)
    residual/depth_entropy/mean                 mean of the above
    residual/mhc_doubly_stochastic_err          max over sites of the mean per-token max |row/col sum - 1|
    residual/mhc_hres_diag/layer{l}             mean diagonal of Hres (1 = identity, 1/n = uniform mixing)
    moe/layer{i}/load_max_over_mean             expert load of the last forward: max / mean (1 = balanced)
    moe/layer{i}/load_entropy                   entropy of the load shares / log(E) (1 = balanced)
    moe/layer{i}/router_bias_norm               L2 norm of the auxiliary-loss-free selection bias
    moe/worst/load_max_over_mean, moe/worst/load_entropy   the worst layer of each
Heatmaps: ``residual/depth_attention`` -> float array [M, L+1, N+1]: stream r, target l (row l-1),
source b_j (column j); NaN where target l cannot see b_j. The partial b_n^{<l} is shown as b_n.

Legend: M streams, L branches, N blocks, E routed experts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from msar_train.model.layers import Block
from msar_train.model.moe import MoE
from msar_train.residual.diagnostics import SiteDiagnostics, record_diagnostics

DEPTH_HEATMAP = "residual/depth_attention"


def _as_inputs(batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(ids, doc_ids, positions) of a data ``Batch`` or a bare ids tensor."""
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    return batch.input_ids_BT, getattr(batch, "doc_ids_BT", None), getattr(batch, "positions_BT", None)


def _batch_list(batches) -> list:
    if isinstance(batches, torch.Tensor) or hasattr(batches, "input_ids_BT"):
        return [batches]
    return list(batches)


@contextlib.contextmanager
def _quiet_forward(model: nn.Module):
    """Eval mode (MoE load counters for the bias update stay untouched), no grad, and every MoE's
    ``last_load`` restored afterwards so ``moe_metrics`` still reports the training batch."""
    was_training = model.training
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    loads = [m.last_load for m in moes]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        for m, load in zip(moes, loads):
            m.last_load = load


def record_residual_diagnostics(model: nn.Module, batches, autocast=None) -> list[SiteDiagnostics]:
    """One recorded forward per batch (a ``Batch``, an ids tensor, or an iterable of them); values
    averaged over the batches. ``autocast``: an optional context (the trainer's) for the forwards."""
    device = next(model.parameters()).device
    with _quiet_forward(model), record_diagnostics(model) as rec:
        for batch in _batch_list(batches):
            ids, doc, pos = (None if t is None else t.to(device) for t in _as_inputs(batch))
            with autocast if autocast is not None else contextlib.nullcontext():
                model(ids, doc, pos)
    return rec.records


def depth_attention_matrix(records: Iterable[SiteDiagnostics]) -> np.ndarray | None:
    """[M, L+1, N+1] depth weights (NaN = source not visible), or None without depth attention."""
    rows = {d.target_index: d.values["depth_alpha"] for d in records if "depth_alpha" in d.values and d.target_index is not None}
    if not rows:
        return None
    n_targets = max(rows)
    n_sources = max(a.shape[0] for a in rows.values())
    M = next(iter(rows.values())).shape[1]
    out = np.full((M, n_targets, n_sources), np.nan, dtype=np.float64)
    for target, alpha_SM in rows.items():
        out[:, target - 1, : alpha_SM.shape[0]] = alpha_SM.double().numpy().T
    return out


def residual_metrics(records: list[SiteDiagnostics]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Scalars and heatmaps (see the module docstring) from recorded diagnostics."""
    scalars: dict[str, float] = {}
    entropies: list[float] = []
    ds_errs: list[float] = []
    for d in sorted(records, key=lambda d: (d.target_index is None, d.target_index or 0, d.name)):
        v = d.values
        tag = f"layer{d.target_index}" if d.target_index is not None else d.name
        if "fusion_weights" in v and v["fusion_weights"].numel() > 1:
            for r, h in enumerate(v["fusion_weights"].tolist()):
                scalars[f"residual/fusion_weight/{tag}/stream{r}"] = h
        if "depth_entropy" in v and "depth_alpha" in v and v["depth_alpha"].shape[0] > 1:
            for r, e in enumerate(v["depth_entropy"].tolist()):
                scalars[f"residual/depth_entropy/{tag}/stream{r}"] = e
                entropies.append(e)
        if "mhc_ds_err" in v:
            ds_errs.append(float(v["mhc_ds_err"]))
        if "mhc_hres" in v:
            scalars[f"residual/mhc_hres_diag/{tag}"] = float(torch.diagonal(v["mhc_hres"]).mean())
    if entropies:
        scalars["residual/depth_entropy/mean"] = float(np.mean(entropies))
    if ds_errs:
        scalars["residual/mhc_doubly_stochastic_err"] = max(ds_errs)
    heatmaps: dict[str, np.ndarray] = {}
    depth = depth_attention_matrix(records)
    if depth is not None:
        heatmaps[DEPTH_HEATMAP] = depth
    return scalars, heatmaps


def collect_residual_metrics(model: nn.Module, batches, autocast=None) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Run one recorded no-grad forward (per batch given) and return ``(scalars, heatmaps)``.

    The model's train/eval mode, the MoE load counters (bias update) and ``MoE.last_load`` are left
    as they were. A backend that records nothing (vanilla) gives ``({}, {})``.
    """
    return residual_metrics(record_residual_diagnostics(model, batches, autocast))


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Routing health of every MoE layer from its ``last_load`` (the last training forward) and
    its router's selection bias. Layers are named by their block's ``layer_idx``."""
    out: dict[str, float] = {}
    worst_ratio, worst_entropy = [], []
    for mod in model.modules():
        if not (isinstance(mod, Block) and isinstance(mod.ffn, MoE)):
            continue
        moe, tag = mod.ffn, f"moe/layer{mod.layer_idx}"
        out[f"{tag}/router_bias_norm"] = float(moe.router.expert_bias.float().norm())
        load = moe.last_load
        if load is None or float(load.sum()) <= 0:
            continue
        load = load.double().cpu()
        ratio = float(load.max() / load.mean())
        p = load / load.sum()
        E = load.numel()
        ent = float(-(p * p.clamp_min(1e-30).log()).sum()) / math.log(E) if E > 1 else 1.0
        out[f"{tag}/load_max_over_mean"] = ratio
        out[f"{tag}/load_entropy"] = ent
        worst_ratio.append(ratio)
        worst_entropy.append(ent)
    if worst_ratio:
        out["moe/worst/load_max_over_mean"] = max(worst_ratio)
        out["moe/worst/load_entropy"] = min(worst_entropy)
    return out


def heatmap_png(
    matrix_per_stream,
    path: str | Path,
    title: str,
    row_labels: list[str] | None = None,
    col_labels: list[str] | None = None,
    xlabel: str = "source b_j",
    ylabel: str = "target l",
) -> Path:
    """One PNG, one panel per stream (``matrix_per_stream``: [M, R, C] array or a list of [R, C]).

    NaN cells (invisible sources) are drawn grey; all panels share one colour scale, [0, max] for
    non-negative data (weights), else the data range. Defaults label rows 1..R (the spec's target
    index) and columns b0..b{C-1}.
    """
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    mats = [np.asarray(m, dtype=np.float64) for m in matrix_per_stream]
    if not mats or any(m.ndim != 2 for m in mats):
        raise ValueError("heatmap_png needs one 2-D matrix per stream")
    R, C = mats[0].shape
    row_labels = row_labels or [str(i + 1) for i in range(R)]
    col_labels = col_labels or [f"b{j}" for j in range(C)]
    finite = np.concatenate([m[np.isfinite(m)] for m in mats]) if mats else np.array([])
    if finite.size == 0:
        lo, hi = 0.0, 1.0
    else:
        lo = 0.0 if finite.min() >= 0 else float(finite.min())
        hi = max(float(finite.max()), lo + 1e-12)
    n = len(mats)
    cols = min(n, 4)
    nrows = math.ceil(n / cols)
    fig = Figure(figsize=(0.35 * C * cols + 2.5, 0.3 * R * nrows + 1.8), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    im = None
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        im = ax.imshow(np.ma.masked_invalid(mats[k]), cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
        ax.set_title(f"stream {k}" if n > 1 else title, fontsize=9)
        ax.set_xticks(range(C), col_labels, fontsize=6, rotation=90 if C > 12 else 0)
        ax.set_yticks(range(R), row_labels, fontsize=6)
        ax.set_xlabel(xlabel, fontsize=8)
        if k % cols == 0:
            ax.set_ylabel(ylabel, fontsize=8)
    if n > 1:
        fig.suptitle(title, fontsize=10)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def depth_attention_png(matrix_MLS: np.ndarray, path: str | Path, title: str = "depth attention") -> Path:
    """``heatmap_png`` of a ``depth_attention_matrix``, the last row labelled as the output target."""
    R = matrix_MLS.shape[1]
    rows = [str(i + 1) for i in range(R - 1)] + [f"{R} out"]
    return heatmap_png(matrix_MLS, path, title, row_labels=rows)


__all__ = [
    "DEPTH_HEATMAP",
    "depth_attention_png",
    "collect_residual_metrics",
    "depth_attention_matrix",
    "heatmap_png",
    "moe_metrics",
    "record_residual_diagnostics",
    "residual_metrics",
]
