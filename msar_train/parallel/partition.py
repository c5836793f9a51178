"""Pipeline partitioning of ``Transformer.layers()`` without allocating weights.

``parts`` follows DeepSpeed's convention: ``P + 1`` increasing layer indices, stage ``s`` owns
``layers[parts[s]:parts[s+1]]``.
"""

from __future__ import annotations

import torch

from msar_train.model.transformer import layer_specs
from msar_train.residual import build_backend


def meta_layer_param_counts(model_cfg, residual_cfg) -> list[int]:
    """Parameters of each layer (shared modules counted in every layer that holds them)."""
    backend = build_backend(residual_cfg, model_cfg.n_layers, model_cfg.d_model, model_cfg.norm_eps, model_cfg.init_std)
    counts = []
    with torch.device("meta"):
        for cls, args in layer_specs(model_cfg, backend):
            counts.append(sum(p.numel() for p in cls(*args).parameters()))
    return counts


def _balanced(weights: list[int], cuts_allowed: list[int], n_parts: int) -> list[int]:
    """Choose ``n_parts - 1`` cuts among ``cuts_allowed`` (a cut c splits before layer c) that
    minimise the heaviest part. Exact dynamic programme; layer counts are small."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    points = [0] + sorted(c for c in set(cuts_allowed) if 0 < c < n) + [n]
    INF = float("inf")
    # best[k][i]: minimal max-part weight covering layers[:points[i]] with k parts ending at points[i]
    best = [[INF] * len(points) for _ in range(n_parts + 1)]
    back = [[-1] * len(points) for _ in range(n_parts + 1)]
    best[0][0] = 0
    for k in range(1, n_parts + 1):
        for i in range(1, len(points)):
            for j in range(i):
                if best[k - 1][j] == INF:
                    continue
                cost = max(best[k - 1][j], prefix[points[i]] - prefix[points[j]])
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    if best[n_parts][-1] == INF:
        raise ValueError(f"cannot cut {n} layers into {n_parts} non-empty stages at the allowed points {points[1:-1]}")
    parts, i = [len(points) - 1], len(points) - 1
    for k in range(n_parts, 0, -1):
        i = back[k][i]
        parts.append(i)
    return [points[i] for i in reversed(parts)]


def partition(model_cfg, residual_cfg, n_stages: int, method: str) -> list[int]:
    """Stage boundaries for ``n_stages`` over the ``n_layers + 2`` layers."""
    n = model_cfg.n_layers + 2
    if n_stages == 1:
        return [0, n]
    if method == "uniform":
        return _balanced([1] * n, list(range(1, n)), n_stages)
    weights = meta_layer_param_counts(model_cfg, residual_cfg)
    if method == "parameters":
        return _balanced(weights, list(range(1, n)), n_stages)
    assert method == "blocks", method
    backend = build_backend(residual_cfg, model_cfg.n_layers, model_cfg.d_model, model_cfg.norm_eps, model_cfg.init_std)
    # A cut before layers[c] follows c - 1 blocks (layers[0] is the embedding).
    allowed = [c for c in range(1, n) if backend.is_cut_point(c - 1)]
    try:
        return _balanced(weights, allowed, n_stages)
    except ValueError as e:
        raise ValueError(
            f"parallel.partition_method=blocks: {e}; the residual blocks allow cuts only before layers {allowed} "
            f"(use more residual.n_blocks, fewer parallel.pp_stages, or partition_method=parameters)"
        ) from e
