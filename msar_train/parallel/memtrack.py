"""Live tensor bytes and their high-water mark, device-independent (CPU included).

``LiveBytes`` is a ``TorchDispatchMode``: every tensor an aten op returns (factory functions, op
outputs, autograd's gradients, optimizer states, DeepSpeed's flat buffers, received pipeline
activations) has its storage recorded once, with a weak reference whose callback subtracts the storage's
bytes when the storage is freed. ``peak`` is the largest sum of live storages seen after any op: what
``torch.cuda.max_memory_allocated`` reports on a GPU, without the caching allocator's block rounding,
and what RSS cannot give (RSS counts the Python heap, shared libraries and freed-but-kept pages).
The same idea as ``torch.distributed._tools.mem_tracker.MemTracker`` without its per-module
bookkeeping (module hooks, which would wrap DeepSpeed's own). Storages made before the mode is entered
are not counted, so enter it before building the model.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _freed(self, nbytes: int, _ref) -> None:
        self.live -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st in self._refs:
            return
        nbytes = st.nbytes()
        self._refs[st] = weakref.ref(st, lambda r, n=nbytes: self._freed(n, r))
        self.live += nbytes

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        if self.live > self.peak:
            self.peak = self.live
        return out
