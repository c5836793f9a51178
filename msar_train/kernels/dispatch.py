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
        # Block-batched phase 1 (torch: kernels/lean_block.py; triton: triton_depth.block_target_forward);
        # False: one phase 1 per target.
        self.batched = True
        self._triton_groups: dict = {}
        if name == "compile":
            lean.use_compiled(True)
        if name == "triton":
            from msar_train.kernels import triton_depth  # lazy: triton is an optional dependency

            self._triton = triton_depth

    def forward(self, target, sources: list[torch.Tensor], partial: torch.Tensor | None, doc_ids_BT: torch.Tensor | None) -> torch.Tensor:
        n = len(sources) + int(partial is not None)
        banks = [self.bank(j) for j in range(n)]
        peers = target.__dict__.get("_peers")
        batch = self.batched and peers and target in peers and sources and _shared()
        if self.name == "triton" and not target.single_source:
            if batch:
                return self._triton.block_target_forward(
                    target, peers, sources, partial, banks, doc_ids_BT, self.num_streams, self._triton_groups
                )
            return self._triton.target_forward(target, sources, partial, banks, doc_ids_BT, self.num_streams)
        if self.name == "torch" and batch:
            return lean_block.target_forward(target, peers, sources, partial, banks, doc_ids_BT, self.num_streams, self.runtime)
        return lean.target_forward(target, sources, partial, banks, doc_ids_BT, self.num_streams, self.runtime)


def _shared() -> bool:
    """False inside a saved-tensor-hooks region (activation checkpointing): targets run on their own."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
