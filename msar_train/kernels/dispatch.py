"""Choice of the depth-attention implementation (``residual.kernel``).

* ``torch``: the memory-lean torch path (``kernels/lean.py``), any device;
* ``compile``: the same path with its tensor math compiled by ``torch.compile``;
* ``triton``: the fused Triton kernels (``kernels/triton_depth.py``; CUDA, or CPU under
  ``TRITON_INTERPRET=1``). Triton is imported only when this kernel is selected.

``residual/depth.py`` routes every ``DepthTarget`` with query parameters through one
``DepthKernel`` per model (held by the backend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from msar_train.kernels import lean, lean_block

KERNELS = ("torch", "triton", "compile")


class DepthKernel:
    """Per-model dispatcher. ``bank(j)`` returns source j's ``SourceExpansion``."""

    def __init__(self, name: str, num_streams: int, bank: Callable[[int], torch.nn.Module]):
        if name not in KERNELS:
            raise ValueError(f"residual.kernel={name!r} is not one of {list(KERNELS)}")
        self.name = name
        self.num_streams = num_streams
        self.bank = bank
        self.runtime = lean.Runtime()
        # Block-batched phase 1 on the torch path (kernels/lean_block.py); False: one phase 1 per target.
        self.batched = True
        if name == "compile":
            lean.use_compiled(True)
        if name == "triton":
            from msar_train.kernels import triton_depth  # lazy: triton is an optional dependency

            self._triton = triton_depth

    def forward(self, target, sources: list[torch.Tensor], partial: torch.Tensor | None, doc_ids_BT: torch.Tensor | None) -> torch.Tensor:
        n = len(sources) + int(partial is not None)
        banks = [self.bank(j) for j in range(n)]
        if self.name == "triton" and not target.single_source:
            return self._triton.target_forward(target, sources, partial, banks, doc_ids_BT, self.num_streams)
        peers = target.__dict__.get("_peers")
        if self.name == "torch" and self.batched and peers and target in peers and sources and _shared():
            return lean_block.target_forward(target, peers, sources, partial, banks, doc_ids_BT, self.num_streams, self.runtime)
        return lean.target_forward(target, sources, partial, banks, doc_ids_BT, self.num_streams, self.runtime)


def _shared() -> bool:
    """False inside a saved-tensor-hooks region (activation checkpointing): targets run on their own."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
