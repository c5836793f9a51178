"""``DecodeCache``: what incremental decoding keeps between forwards of one batch of sequences.

A forward with ``SeqContext.cache`` set (``Transformer.decode``) reads only the new tokens; whatever
earlier tokens contribute comes from the cache:

* every ``Attention`` module: the keys and values of all tokens so far (after RoPE);
* a residual backend whose modules mix along the sequence: the per-token state they read back. MSAR's
  causal convolutions read the last ``max(kernel_sizes) - 1`` positions of every source, so the cache
  keeps that many positions of each completed summary (the embedding ``b_0`` included) and of each
  target's partial (``residual/depth.py``). Vanilla, mHC and AttnRes mix nothing along the sequence
  outside attention: they keep nothing here (docs/decisions.md "Cached generation");
* the document id of every token so far (padding of a left-padded batch is a document of its own, so
  neither attention nor a convolution reads it from a real token).

Every tensor is batch-first, so beam search reorders the cache with one ``index_select`` per entry.
The model never learns what a key means: modules file their own entries under keys they choose.

Legend: B batch, T sequence.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class DecodeCache:
    is_croppable = False  # transformers' generate: no rollback of a step
    is_compileable = False

    def __init__(self) -> None:
        self.seen = 0  # tokens per row already folded into the cache
        self.doc_ids_BT: torch.Tensor | None = None  # document id of every seen token (None: never given)
        self.tensors: dict[Hashable, torch.Tensor] = {}
        # Tensors shared by the modules of the current forward only (e.g. the document ids of a
        # convolution window); dropped when the forward ends.
        self.scratch: dict[Hashable, object] = {}

    # transformers' Cache protocol, as far as generate uses it
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Keep row ``beam_idx[i]`` as row ``i`` (beam search)."""
        self.tensors = {k: v.index_select(0, beam_idx.to(v.device)) for k, v in self.tensors.items()}
        if self.doc_ids_BT is not None:
            self.doc_ids_BT = self.doc_ids_BT.index_select(0, beam_idx.to(self.doc_ids_BT.device))

    def check_step(self, batch: int, doc_ids_BT: torch.Tensor | None) -> None:
        """Refuse a forward that cannot continue this cache (called before any module reads it)."""
        if self.seen and self.tensors:
            rows = next(iter(self.tensors.values())).shape[0]
            if rows != batch:
                raise ValueError(f"DecodeCache holds {rows} sequences, this forward has {batch}")
        if self.seen and (doc_ids_BT is None) != (self.doc_ids_BT is None):
            raise ValueError("DecodeCache: doc_ids must be given on every forward of a sequence or on none")

    def advance(self, doc_ids_BT: torch.Tensor | None, n_new: int) -> None:
        """Fold the current forward's ``n_new`` tokens into the bookkeeping (modules already stored theirs)."""
        if doc_ids_BT is not None:
            self.doc_ids_BT = doc_ids_BT if self.doc_ids_BT is None else torch.cat([self.doc_ids_BT, doc_ids_BT], 1)
        self.seen += n_new
        self.scratch.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


__all__ = ["DecodeCache"]
