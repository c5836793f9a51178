"""Point-to-point traffic of the (interleaved) pipeline, with and without the cross-stage cache.

The model ``Transformer.layers()`` is cut into ``C = P * V`` chunks; chunk ``c`` runs on pipeline rank
``c mod P`` (spec, "Cross-stage cache"). Hop ``c`` carries the layer carry at the input of chunk ``c``
(``c = 1..C-1``) from rank ``(c-1) mod P`` to rank ``c mod P``; backward returns the gradients of its
floating-point tensors. The carry is ``(aux, [doc_ids, positions,] *state)`` (``model/layers.py``).

Cross-stage cache: the leading ``n`` state tensors of a depth-attention backend are completed single-stream
summaries ``b_0..b_{n-1}`` that never change again. A rank keeps, per micro-batch, the completed summaries
at the output of its previous chunk (produced there or received), so hop ``c >= P`` carries only the
summaries completed since: indices ``[n(c-P+1), n(c))`` where ``n(k)`` counts the completed summaries at
cut ``k``. The hidden/partial state, the aux loss and the document context always travel.

This module is the single source of both the engine's wire format (``hop_plan``) and the planner's byte
counts (``comm_plan``), so measured and planned bytes agree by construction of the same plan, and the
engine's counter checks it at the point-to-point layer.

Legend: P pipeline ranks, V chunks per rank, C chunks, M micro-batches per step, B micro-batch size,
T sequence length, D d_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the carry at a cut. ``kind``: aux | context | summary | state."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point


@dataclass(frozen=True)
class Hop:
    """Hop into chunk ``dst``: ``send`` = carry positions on the wire, ``cached`` = carry positions the
    receiving rank takes from its cache (completed summaries it already holds for the micro-batch)."""

    dst: int
    specs: tuple[TensorSpec, ...]
    send: tuple[int, ...]
    cached: tuple[int, ...]

    @property
    def forward_bytes(self) -> int:
        return sum(self.specs[i].nbytes for i in self.send)

    @property
    def backward_bytes(self) -> int:
        return sum(self.specs[i].nbytes for i in self.send if self.specs[i].floating)

    @property
    def bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def completed_summaries(backend, after_layer: int) -> int:
    """How many leading state tensors after ``after_layer`` blocks are completed single-stream summaries.

    Depth-attention backends (attnres, msar) expose their ``BlockLayout``; any other backend's state
    (vanilla's hidden state, mHC's streams) changes at every layer and is never cacheable."""
    layout = getattr(backend, "layout", None)
    if layout is None:
        return 0
    return layout.state_after(2 * after_layer)[0]


def carry_specs(backend, after_layer: int, batch: int, seq: int, dtype: torch.dtype, document_mask: bool) -> tuple[TensorSpec, ...]:
    """The carry crossing a cut placed after ``after_layer`` transformer blocks (0 = after the embedding)."""
    specs = [TensorSpec((), dtype, "aux")]
    if document_mask:
        specs += [TensorSpec((batch, seq), torch.int64, "context")] * 2
    n_done = completed_summaries(backend, after_layer)
    for i, shape in enumerate(backend.state_shapes(after_layer, batch, seq)):
        specs.append(TensorSpec(tuple(shape), dtype, "summary" if i < n_done else "state"))
    return tuple(specs)


def n_summaries(specs: tuple[TensorSpec, ...]) -> int:
    return sum(s.kind == "summary" for s in specs)


def summary_positions(specs: tuple[TensorSpec, ...]) -> list[int]:
    """Carry positions of the completed summaries, in summary order (b_0 first)."""
    return [i for i, s in enumerate(specs) if s.kind == "summary"]


def hop_plan(cut_specs: dict[int, tuple[TensorSpec, ...]], P: int, cache: bool) -> dict[int, Hop]:
    """Hops ``c = 1..C-1`` given the carry at every chunk input (``cut_specs[c]``)."""
    hops = {}
    for c in sorted(cut_specs):
        specs = cut_specs[c]
        have = n_summaries(cut_specs[c - P + 1]) if cache and c >= P else 0
        cached = tuple(summary_positions(specs)[:have])
        send = tuple(i for i in range(len(specs)) if i not in cached)
        hops[c] = Hop(c, specs, send, cached)
    return hops


def chunk_cut_specs(backend, parts: list[int], batch: int, seq: int, dtype: torch.dtype, document_mask: bool) -> dict[int, tuple]:
    """``parts`` = the ``C + 1`` layer boundaries of the chunks; a cut before ``layers[k]`` follows
    ``k - 1`` blocks (``layers[0]`` is the embedding)."""
    return {c: carry_specs(backend, parts[c] - 1, batch, seq, dtype, document_mask) for c in range(1, len(parts) - 1)}


def step_bytes(hops: dict[int, Hop], micro_batches: int) -> int:
    """Bytes one pipeline (one data-parallel replica) sends in one training step, both directions."""
    return micro_batches * sum(h.bytes for h in hops.values())


def paper_elements_per_token(P: int, V: int, blocks_per_chunk: float, d: int) -> tuple[float, float]:
    """The AttnRes paper's per-token summary traffic (spec): naive ``C(C-1)/2 N_p d`` and cached
    ``P(P-1)/2 N_p d + (V-1) P^2 N_p d`` elements, forward only, ``C = P V``."""
    C = P * V
    naive = C * (C - 1) / 2 * blocks_per_chunk * d
    cached = P * (P - 1) / 2 * blocks_per_chunk * d + (V - 1) * P * P * blocks_per_chunk * d
    return naive, cached


def comm_plan(cfg) -> dict:
    """Per-step point-to-point bytes of one pipeline for ``cfg`` (any P, V and block layout):
    ``comm_bytes_naive`` (every hop carries the whole carry) and ``comm_bytes_cached`` (with the
    cross-stage cache), both directions, plus per-hop figures and the paper's formulas."""
    from msar_train.parallel.ds_config import resolve_dtype
    from msar_train.parallel.partition import partition
    from msar_train.residual import build_backend

    m, p = cfg.model, cfg.parallel
    P, V = p.pp_stages, p.get("virtual_stages", 1)
    C = P * V
    if P < 2:
        return {"comm_chunks": 1, "comm_bytes_naive": 0, "comm_bytes_cached": 0}
    backend = build_backend(cfg.residual, m.n_layers, m.d_model, m.norm_eps, m.init_std)
    parts = partition(m, cfg.residual, C, p.partition_method)
    dtype = resolve_dtype(p, "cuda" if torch.cuda.is_available() else "cpu")
    specs = chunk_cut_specs(backend, parts, p.micro_batch_size, cfg.data.seq_len, dtype, cfg.data.document_mask)
    naive, cached = hop_plan(specs, P, cache=False), hop_plan(specs, P, cache=True)
    n_blocks = completed_summaries(backend, m.n_layers) - 1  # b_1..b_N (0 for non-depth backends)
    tokens = p.micro_batch_size * cfg.data.seq_len * p.grad_accum
    elem = torch.empty((), dtype=dtype).element_size()
    paper_naive, paper_cached = paper_elements_per_token(P, V, n_blocks / C, m.d_model)
    return {
        "comm_chunks": C,
        "comm_parts": list(parts),
        "comm_bytes_naive": step_bytes(naive, p.grad_accum),
        "comm_bytes_cached": step_bytes(cached, p.grad_accum),
        "comm_hop_bytes_naive": [naive[c].bytes for c in sorted(naive)],
        "comm_hop_bytes_cached": [cached[c].bytes for c in sorted(cached)],
        "comm_paper_summary_bytes_naive": int(paper_naive * tokens * elem),
        "comm_paper_summary_bytes_cached": int(paper_cached * tokens * elem),
    }
