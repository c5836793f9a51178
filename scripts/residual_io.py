#!/usr/bin/env python
"""Residual-path I/O per token per layer, analytic and counted (issue 14 item 3).

    python scripts/residual_io.py [--config small deep] [--backends vanilla attnres attnres_full msar msar_full mhc]
                                  [--kernels torch triton] [--batch 2] [--seq 67] [--dtype float32|bfloat16]
                                  [--no-backward] [--json OUT]

Unit: bytes per token per layer in units of ``d x elem`` (d = d_model, elem = bytes of one element of
the activation dtype). A *layer* is one residual branch (a sublayer: attention or FFN/MoE), as in the
spec (``L = 2 * n_layers``) and the AttnRes paper. Everything the residual path does in a forward
(entry, the L sites, the exit / output aggregation) is summed and divided by ``tokens x L``, so the
entry and the exit are amortised over the layers. fp32 statistics (softmax logits, lse, inverse RMS,
gates) are counted at their real 4 bytes, i.e. ``4 / elem / d`` per value in these units.

analytic: what our implementation reads and writes if each of its functions (autograd Function,
Triton kernel, the fusion mixer) were one fused kernel that reads each input once and writes each
output once; copies made only to hand tensors to a kernel (``torch.stack`` of the sources, dtype casts
of an fp32 input) are not in it. One figure per (backend, kernel), see ``analytic`` below for the
terms. ``spec ideal``: the fused two-phase design of the spec ("Two-phase computation"): phase 1 once
per block over its completed summaries, the expanded streams never written, only ``Z_l`` materialised
for the fusion; it does not depend on the kernel.

counted: one real training step (forward, then backward of the LM loss) at ``--batch x --seq``. A
``TorchDispatchMode`` sums, for every aten op issued while the residual backend's own code runs, the
bytes of the tensors it reads (inputs) and writes (outputs; in-place and ``out=`` targets count as
written, an in-place ``self`` also as read). Views and aliases cost nothing (ops whose result aliases
an input, and ``empty``-like allocations, are skipped); a broadcast (stride-0) input counts its
physical bytes. The residual code is: the backend's entry, each site's ``forward`` *minus* the branch
callable it is handed (attention/FFN/MoE run with counting off), and the exit; in the backward, the
autograd nodes those regions created (found by walking the graph from their outputs back to their
inputs and the branch outputs). Not counted: the engine's accumulation of gradients for a tensor with
several consumers (it runs between nodes, e.g. vanilla's ``dh = d(h + f) + d(branch input)``) and the
``AccumulateGrad`` of the parameters. Triton (``--kernels triton``): each launch of a kernel of
``kernels/triton_depth.py`` counts the bytes of its tensor arguments, reads and writes by the kernel's
signature (``LAUNCH_IO``); a launch that works on one source ``j`` (backward ``_p1_dE``, ``_conv_ds``,
``_conv_dw``) counts that source's slice of the per-source tensors only. Each argument counts once per
launch, i.e. the bytes a kernel touches, a lower bound on its DRAM traffic: the kernels read a source
tile K times for the conv taps and twice (pass A, pass B), from cache in the best case, and re-load
the logits they stored in pass A. The torch ops around the launches count as above. The native
CPU loops of the torch path (``kernels/cpu_native.py``, used on CPU for fp32/fp64) count the same
way: each call the bytes of its tensor arguments (read) and results (written), one pass.

Per token: the step runs at batch ``B`` and at batch 1 (same T); the difference of the byte counts
divided by ``(B - 1) x T`` is what each token adds (the residual path is linear in the batch), and
``param`` = the batch-1 count minus T tokens' worth is what does not scale with the tokens
(parameters, stacked conv weights; reported apart in bytes per step, since per token it shrinks
with the batch). Token boundary effects stay in: a causal conv tap over ``T - delta`` positions
counts ``(T - delta) / T`` of a [B,T,D] tensor.

Output: a markdown table per config on stdout and ``--json OUT``, one object per (config, backend, kernel).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import contextmanager, nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

from bench_residuals import model_config, residual_config  # noqa: E402

from msar_train.model.transformer import Transformer, lm_loss  # noqa: E402
from msar_train.residual.layout import BlockLayout  # noqa: E402

BACKENDS = ["vanilla", "attnres", "attnres_full", "msar", "msar_full", "mhc"]
DEPTH = ("attnres", "msar")  # residual.name of the backends with a depth-attention kernel
# Per-layer residual I/O of the AttnRes paper (forward, per token, units of d); mHC's is for n = 4.
PAPER = {"vanilla": 3.0, "attnres": 5.5, "mhc": 34.0}

aten = torch.ops.aten
# No memory traffic: allocations without initialisation and metadata-only ops whose schema does not
# declare the alias (``_unsafe_view`` follows a copy in ``reshape``; ``resize_`` shapes ``out=``).
NO_TRAFFIC = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten._unsafe_view.default,
    aten.resize_.default,
    aten.lift_fresh.default,
}
# In-place ops that overwrite ``self`` without reading it, and factories that take only the dtype,
# device and (for ``*_like``) shape of their tensor argument: they write, and read nothing.
WRITE_ONLY_SELF = {aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor}
NO_READ = {
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
}


def physical_numel(t: torch.Tensor) -> int:
    """Distinct elements a strided tensor addresses (a broadcast dim with stride 0 counts once)."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) if t.numel() else 0


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


class IOCounter(TorchDispatchMode):
    """Sums the bytes aten ops (and Triton launches) read and write while ``on``.

    ``on`` in the forward: inside a residual region (a stack: True in a site, False inside its branch);
    in the backward: while a node of a residual region runs (``bwd_node``). ``suspend`` > 0 inside a
    Triton launch, whose interpreter's own torch calls are not traffic of the kernel."""

    def __init__(self):
        super().__init__()
        self.stack: list[bool] = []
        self.bwd_node = False
        self.suspend = 0
        self.phase = "fwd"
        self.bytes: Counter = Counter()  # (phase, "read" | "write") -> bytes
        self.ops: Counter = Counter()  # (phase, op or kernel name) -> bytes

    @property
    def on(self) -> bool:
        return not self.suspend and (self.bwd_node or bool(self.stack and self.stack[-1]))

    def add(self, name: str, rw: str, t: torch.Tensor, fraction: float = 1.0) -> None:
        nbytes = physical_numel(t) * t.element_size() * fraction
        self.bytes[(self.phase, rw)] += nbytes
        self.ops[(self.phase, name)] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on:
            self.count(func, args, kwargs, out)
        return out

    def count(self, func, args, kwargs, out) -> None:
        schema = func._schema
        if func in NO_TRAFFIC or any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return  # a view / alias, or an allocation
        reads: list[torch.Tensor] = []
        for i, a in enumerate([] if func in NO_READ else schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if a.is_out:
                continue  # written: counted with the returns
            if a.alias_info is not None and a.alias_info.is_write and func in WRITE_ONLY_SELF:
                continue
            reads += _tensors(v)
        name = func.overloadpacket.__name__
        for t in reads:
            self.add(name, "read", t)
        for t in _tensors(out):
            self.add(name, "write", t)


# --- residual regions: which ops (and autograd nodes) belong to the residual path -----------------


def _walk(starts, stops: set[int]) -> list:
    """Autograd nodes reachable from ``starts`` without entering a node in ``stops`` (by id)."""
    seen, out, todo = set(stops), [], [n for n in starts if n is not None]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            continue  # the parameters' gradient accumulation: not counted
        out.append(node)
        todo += [n for n, _ in node.next_functions if n is not None]
    return out


class ResidualScope:
    """Hooks that switch ``counter`` on for the residual backend's code of ``model`` (see module doc)."""

    def __init__(self, model: Transformer, counter: IOCounter):
        self.counter = counter
        self.hooked: set[int] = set()
        self.nodes: list = []  # keeps the hooked nodes (and their ids) alive
        self.handles = []
        regions = [model.embed.entry, model.head.exit]
        for block in model.blocks:
            regions += [block.attn_site, block.ffn_site]
        for mod in regions:
            self.handles.append(mod.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._leave, with_kwargs=True))
        self._pending: list[tuple[list, list]] = []  # per open region: (branch inputs, branch outputs)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _enter(self, module, args, kwargs):
        branch_in, branch_out = [], []
        self._pending.append((branch_in, branch_out))
        self.counter.stack.append(True)
        if len(args) >= 2 and callable(args[1]):  # a site: forward(state, branch, ctx)
            branch = args[1]
            counter = self.counter

            def counted_branch(h_BTD):
                branch_in.append(h_BTD)
                counter.stack.append(False)
                try:
                    v_BTD = branch(h_BTD)
                finally:
                    counter.stack.pop()
                branch_out.append(v_BTD)
                return v_BTD

            return (args[0], counted_branch, *args[2:]), kwargs
        return None

    def _leave(self, module, args, kwargs, output):
        self.counter.stack.pop()
        branch_in, branch_out = self._pending.pop()
        inputs = _tensors(args[0])
        outputs = _tensors(output) + branch_in
        stops = {id(t.grad_fn) for t in inputs + branch_out if t.grad_fn is not None}
        for node in _walk([t.grad_fn for t in outputs], stops):
            if id(node) in self.hooked:
                continue
            self.hooked.add(id(node))
            self.nodes.append(node)
            node.register_prehook(self._node_start)
            node.register_hook(self._node_end)
        return None

    def _node_start(self, grad_outputs):
        self.counter.bwd_node = True

    def _node_end(self, grad_inputs, grad_outputs):
        self.counter.bwd_node = False


# --- Triton launches ------------------------------------------------------------------------------

# Per kernel of kernels/triton_depth.py: its tensor arguments in signature order, as read (r), written
# (w) or, with a suffix "j", only source j's slice (1/S of the tensor; S = the tensor's per-source dim).
LAUNCH_IO = {
    "_p1_fwd": "src:r W:r ks:r qg:r doc:r z:w lse:w L:w rinv:w",
    "_p1_stats": "src:r W:r ks:r doc:r lse:r L:r rinv:r dz:r dlse:r P:w A1:w A2:w dqg:w",
    "_p1_dE": "src:rj0 W:rj0 ks:r qg:r doc:r dz:r P:rj2 A1:rj2 A2:rj2 dE:w",
    "_conv_ds": "W:rj0 ks:r doc:r dE:r ds:wj0",
    "_conv_dw": "src:rj0 ks:r doc:r dE:r dW:wj1",
    "_p2_fwd": "z1:r lse:r src:r W:r ks:r qg:r doc:r z:w",
    "_p2_bwd": "z1:r lse:r src:r W:r ks:r qg:r doc:r dz:r dz1:w dlse:w dE:w dqg:w",
}


class _CountedKernel:
    """Stands in for one ``@triton.jit`` kernel: ``kernel[grid](*args)`` counts, then launches."""

    def __init__(self, name: str, kernel, counter: IOCounter):
        self.name, self.kernel, self.counter = name, kernel, counter
        self.io = [f.split(":") for f in LAUNCH_IO[name].split()]

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            c = self.counter
            if c.on:
                for (_, mode), t in zip(self.io, args):
                    assert isinstance(t, torch.Tensor), f"{self.name}: argument layout changed"
                    frac = 1.0 / t.shape[int(mode[2])] if len(mode) == 3 else 1.0
                    c.add(self.name, "read" if mode[0] == "r" else "write", t, frac)
            c.suspend += 1
            try:
                return run(*args, **kwargs)
            finally:
                c.suspend -= 1

        return launch


@contextmanager
def counted_launches(counter: IOCounter):
    from msar_train.kernels import triton_depth as td

    saved = {name: getattr(td, name) for name in LAUNCH_IO}
    try:
        for name, k in saved.items():
            setattr(td, name, _CountedKernel(name, k, counter))
        yield
    finally:
        for name, k in saved.items():
            setattr(td, name, k)


# --- native CPU loops (kernels/cpu_native.py) -------------------------------------------------------

# Per function: the names of its tensor arguments it writes (all other tensor arguments are read; an
# argument listed in both is read and written); its returned tensors are written.
NATIVE_IO = {
    "conv_forward": ((), ()),
    "conv_backward": ((), ()),
    "weighted_sum": ((), ()),
    "phase1_dots": ((), ()),
    "phase1_grad": ((6, 7), (7,)),  # out (written), dqg (accumulated: read and written)
    "fuse_forward": ((), ()),
    "fuse_backward": ((), ()),
    "row_dots": ((), ()),
    "sinkhorn_forward": ((), ()),
    "sinkhorn_backward": ((), ()),
    "premix": ((), ()),
    "premix_backward": ((), ()),
    "postmix": ((), ()),
    "postmix_backward": ((), ()),
}


@contextmanager
def counted_native(counter: IOCounter):
    """Each call of a native loop counts the bytes of its tensor arguments and results (one fused
    pass); the torch ops inside the wrapper (casts, the transposed fusion weight) are not counted."""
    from msar_train.kernels import cpu_native as cn

    saved = {name: getattr(cn, name) for name in NATIVE_IO}

    def wrap(name, fn):
        written, also_read = NATIVE_IO[name]

        def call(*args, **kwargs):
            c = counter
            if c.on:
                for i, v in enumerate(args):
                    if i not in written or i in also_read:
                        for t in _tensors(v):
                            c.add(name, "read", t)
            c.suspend += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                c.suspend -= 1
            if c.on:
                for t in _tensors(out) + [t for i in written for t in _tensors(args[i])]:
                    c.add(name, "write", t)
            return out

        return call

    try:
        for name, fn in saved.items():
            setattr(cn, name, wrap(name, fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(cn, name, fn)


# --- analytic -------------------------------------------------------------------------------------


class Tally:
    """Reads and writes in units of d x elem per token (summed over the whole residual path)."""

    def __init__(self):
        self.reads = 0.0
        self.writes = 0.0

    def __call__(self, reads: float = 0.0, writes: float = 0.0) -> None:
        self.reads += reads
        self.writes += writes

    def per_layer(self, L: int) -> dict:
        return {"reads": self.reads / L, "writes": self.writes / L, "total": (self.reads + self.writes) / L}


def analytic(res, n_layers: int, d: int, elem: int, kernel: str) -> tuple[dict, dict]:
    """(ours, spec ideal): forward residual I/O per token per layer, units of d x elem.

    ``st`` = one fp32 per-token statistic, ``4 / elem / d`` in these units. Per backend:

    vanilla, per branch: read h and f(h), write h + f: 2 + 1 = 3. Entry and exit move nothing.

    mhc (n streams), per branch, as two fused passes: the maps pass reads the n streams and writes the
    branch input Hpre x and the maps (Hpre, Hpost: n each, Hres: n^2 fp32 values); the update pass reads
    the streams, f(h) and the maps and writes the n new streams: (2n + 1) + (n + 1), plus 2 (2n + n^2) st.
    Entry: read the embedding, write n copies; exit: read n streams, write their mean (amortised over L).

    attnres / msar (M streams, C = M - 1 conv streams, 0 for AttnRes; N blocks; target l of block n
    reads the n completed summaries b_0..b_{n-1} and, unless it opens its block, the partial b_n^{<l}):
    * every target with a partial, after its branch: read the partial and f(h), write the new partial
      (2 + 1); the first target of a block stores f(h) as the partial, no op.
    * torch path (kernels/lean_block.py, lean.py): each completed source, once per forward: read it,
      write its C conv streams and M inverse RMS (shared by every reader, released after the last);
      per block, phase 1 for its Q targets at once (``Phase1Node``): read the n x M streams and inverse
      RMS, write the logits (n M Q st) and lse (M Q st); per target (``BlockTargetFn``): read the n x M
      streams again (z1 is recomputed, not stored), their inverse RMS, its logits and lse, the partial
      (its conv streams are formed inside), write h plus the fusion statistics (adaptive: H, the gate
      logits, the inverse RMS: 2M + 1 st). Branch 1 reads b_0 alone (``lean.TargetFn``: read its M
      streams, write h). The exit is a block of its own (Q = 1) over b_0..b_N.
    * triton path (kernels/triton_depth.py, ``block_target_forward``): per block one ``_p1_fwd`` launch
      for its Q targets reads the n sources once (the conv runs in registers) and writes per target
      z1 (M, fp32: 4 / elem each), lse (M st), the logits and inverse RMS (2 n M st); ``_p2_fwd``
      (with a partial) reads z1, lse and the partial and writes z (M); without a partial z = z1 (a
      cast when the activations are not fp32); for M > 1 (or adaptive fusion) the fusion reads z (M)
      and writes h (1, plus the fusion statistics). Branch 1 runs the torch path (as above).
    * spec ideal: per block, phase 1 reads the n summaries once and writes z1 (M) and lse (M st) per
      target; phase 2 (with a partial) reads z1, lse and the partial and writes Z_l (M; for M = 1 it
      is h); for M > 1 the fusion reads Z_l and writes h. The exit: phase 1 over b_0..b_N.
    """
    st = 4.0 / elem / d
    L = 2 * n_layers
    ours, ideal = Tally(), Tally()
    if res.name == "vanilla":
        ours(2 * L, L)
        return ours.per_layer(L), ours.per_layer(L)
    if res.name == "mhc":
        n = res.mhc_streams
        maps = (2 * n + n * n) * st
        ours(1 + n, n + 1)  # entry, exit
        ours(L * (n + n + 1 + maps), L * (1 + maps + n))
        return ours.per_layer(L), ours.per_layer(L)
    assert res.name in DEPTH, res.name
    M = 1 if res.name == "attnres" else res.num_streams
    conv = res.name == "msar" and res.expansion == "conv" and M > 1
    C = M - 1 if conv else 0
    fstat = (2 * M + 1) * st if res.name == "msar" and res.fusion == "adaptive" else 0.0
    lay = BlockLayout(L, L if res.n_blocks is None else res.n_blocks)
    N = lay.n_blocks
    zf = 4.0 / elem  # Triton's z1 is fp32
    # (n completed sources, has partial, single source) of every target, the exit last.
    targets = [(lay.block_of(b), not lay.is_first(b), b == 1) for b in range(1, L + 1)]
    for _n, partial, _ in targets:
        if partial:
            ours(2, 1)
            ideal(2, 1)

    def expansion():  # one completed source, shared by its readers (torch path)
        ours(1, C + M * st)

    def lean_single():  # branch 1 on the torch path: b_0's streams -> h
        ours(M + M * st, 1 + fstat)

    # phase-1 groups: (n completed sources, Q targets of block n that read them), the exit a block of its own
    groups = [(n, sum(1 for m, _, s in targets if m == n and not s)) for n in range(1, N + 1)] + [(N + 1, 1)]
    if kernel == "torch":
        for _ in range(N + 1):
            expansion()
        lean_single()
        for n, Q in groups:
            if Q:
                ours(n * M * (1 + st), (n * M * Q + M * Q) * st)
        for n, partial, single in [*targets, (N + 1, False, False)]:
            if not single:
                ours(n * M * (1 + st) + (n * M + M) * st + int(partial), 1 + fstat)
    else:
        expansion()  # b_0, for branch 1
        lean_single()
        for n, Q in groups:
            if Q:
                ours(n, 0)  # phase 1 of the block's Q targets (one launch) reads the n sources once
        for n, partial, single in [*targets, (N + 1, False, False)]:
            if single:
                continue
            ours(0, M * zf + M * st + 2 * n * M * st)  # its z1 (fp32), lse, logits and inverse RMS
            if partial:
                ours(M * zf + M * st + 1, M)  # phase 2: read z1, lse, the partial; write z
            elif zf != 1:
                ours(M * zf, M)  # z = z1 cast to the activations' dtype
            if M > 1 or fstat:
                ours(M, 1 + fstat)  # the fusion (one stream with mean fusion: h is z)
    # spec ideal
    for n in range(1, N + 2):
        members = [(p, s) for m, p, s in targets if m == n] if n <= N else [(False, False)]
        ideal(n, len(members) * M * (1 + st))
        for partial, _ in members:
            if partial:
                ideal(M * (1 + st) + 1, M)
            if M > 1:
                ideal(M, 1)
    return ours.per_layer(L), ideal.per_layer(L)


# --- one measurement ------------------------------------------------------------------------------


def build(config: str, backend: str, kernel: str, dtype: torch.dtype, layers: int | None = None, d_model: int | None = None):
    mc = model_config(config)
    if layers:
        mc.n_layers = layers
    if d_model:
        mc.d_model = d_model
    res = residual_config(backend, kernel)
    if res.n_blocks is not None and res.n_blocks > 2 * mc.n_layers:  # shrunk test models (as bench_residuals does)
        res.n_blocks = 2 * mc.n_layers
    model = Transformer(mc, res, seed=0).to(dtype=dtype)
    return mc, res, model


def measure(model: Transformer, ids: torch.Tensor, kernel: str, backward: bool = True) -> IOCounter:
    """Bytes the residual path of ``model`` moves in one step on ``ids`` (forward; backward too)."""
    counter = IOCounter()
    scope = ResidualScope(model, counter)
    model.zero_grad(set_to_none=True)
    launches = counted_launches(counter) if kernel == "triton" else nullcontext()
    native = counted_native(counter)
    try:
        with launches, native, counter:
            loss, _ = lm_loss(model(ids), ids)
            if backward:
                counter.phase = "bwd"
                loss.backward()
    finally:
        scope.remove()
    assert not counter.stack and not counter.suspend
    return counter


def per_token(big: IOCounter, one: IOCounter, extra_tokens: int, norm: float, phases: tuple[str, ...]) -> dict:
    """reads / writes / total that each token adds, per layer, in units of d x elem."""
    r, w = (sum(big.bytes[(p, rw)] - one.bytes[(p, rw)] for p in phases) / extra_tokens / norm for rw in ("read", "write"))
    return {"reads": r, "writes": w, "total": r + w}


def fixed_bytes(big: IOCounter, one: IOCounter, batch: int, phases: tuple[str, ...]) -> float:
    """Bytes of one step that do not scale with the tokens (batch-1 count minus one row's share)."""
    b1 = sum(one.bytes[(p, rw)] for p in phases for rw in ("read", "write"))
    bb = sum(big.bytes[(p, rw)] for p in phases for rw in ("read", "write"))
    return b1 - (bb - b1) / (batch - 1)


def top_ops(big: IOCounter, one: IOCounter, phase: str, extra_tokens: int, norm: float, k: int = 6) -> list[list]:
    ops = Counter({name: v - one.ops[(p, name)] for (p, name), v in big.ops.items() if p == phase})
    return [[name, v / extra_tokens / norm] for name, v in ops.most_common(k)]


def run_one(config: str, backend: str, kernel: str, a) -> dict:
    if a.batch < 2:
        raise ValueError(f"--batch {a.batch}: must be >= 2 (the per-token figure is the difference to batch 1)")
    dtype = getattr(torch, a.dtype)
    mc, res, model = build(config, backend, kernel, dtype, a.layers, a.d_model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (a.batch, a.seq), generator=g)
    elem = torch.empty(0, dtype=dtype).element_size()
    L = 2 * mc.n_layers
    t0 = time.perf_counter()
    big = measure(model, ids, kernel, backward=not a.no_backward)
    one = measure(model, ids[:1], kernel, backward=not a.no_backward)
    wall = time.perf_counter() - t0
    extra = (a.batch - 1) * a.seq
    norm = L * mc.d_model * elem
    ours, ideal = analytic(res, mc.n_layers, mc.d_model, elem, kernel)
    fwd = per_token(big, one, extra, norm, ("fwd",))
    is_depth = res.name in DEPTH
    row = {
        "config": config,
        "backend": backend,
        "kernel": kernel if is_depth else "-",
        "n_layers": mc.n_layers,
        "n_branches": L,
        "d_model": mc.d_model,
        "n_blocks": (L if res.n_blocks is None else res.n_blocks) if is_depth else None,
        "batch": a.batch,
        "seq": a.seq,
        "dtype": a.dtype,
        "elem_bytes": elem,
        "analytic_fwd": ours,
        "spec_ideal_fwd": ideal,
        "counted_fwd": fwd,
        "counted_over_analytic": fwd["total"] / ours["total"],
        "fixed_fwd_bytes": fixed_bytes(big, one, a.batch, ("fwd",)),
        "paper_fwd": paper_figure(res),
        "paper_note": paper_note(res),
        "top_ops_fwd": top_ops(big, one, "fwd", extra, norm),
        "wall_s": wall,
    }
    if not a.no_backward:
        row["counted_bwd"] = per_token(big, one, extra, norm, ("bwd",))
        row["counted_fwd_bwd"] = per_token(big, one, extra, norm, ("fwd", "bwd"))
        row["fixed_bwd_bytes"] = fixed_bytes(big, one, a.batch, ("bwd",))
        row["top_ops_bwd"] = top_ops(big, one, "bwd", extra, norm)
    return row


def paper_figure(res) -> float | None:
    if res.name == "mhc":
        return PAPER["mhc"] if res.mhc_streams == 4 else None
    if res.name in DEPTH and res.n_blocks is None:
        return None  # Full variants: no per-layer figure in the papers
    return PAPER["attnres" if res.name == "msar" else res.name]


def paper_note(res) -> str:
    if res.name == "vanilla":
        return "AttnRes paper"
    if res.name == "mhc":
        return "AttnRes paper (mHC, n=4)" if res.mhc_streams == 4 else "paper figure is for n=4"
    if res.n_blocks is None:
        return "no paper figure"
    if res.name == "attnres":
        return "AttnRes paper (Block AttnRes)"
    return "MSAR paper: same as Block AttnRes (claim)"


# --- report ---------------------------------------------------------------------------------------


def _rwt(x: dict) -> str:
    return f"{x['reads']:.2f} + {x['writes']:.2f} = **{x['total']:.2f}**"


def table(rows: list[dict]) -> str:
    bwd = "counted_fwd_bwd" in rows[0]
    head = "| backend | kernel | paper | ours analytic (r + w) | counted fwd (r + w) | counted / analytic | spec ideal |"
    sep = "|---|---|---|---|---|---|---|"
    if bwd:
        head += " counted fwd+bwd |"
        sep += "---|"
    head += " fixed bytes / fwd |"
    sep += "---|"
    lines = [head, sep]
    for r in rows:
        paper = "-" if r["paper_fwd"] is None else f"{r['paper_fwd']:g}"
        if r["backend"] == "msar" and r["paper_fwd"] is not None:
            paper += " (claim)"
        line = (
            f"| {r['backend']} | {r['kernel']} | {paper} | {_rwt(r['analytic_fwd'])} | {_rwt(r['counted_fwd'])} "
            f"| {r['counted_over_analytic']:.2f} | {r['spec_ideal_fwd']['total']:.2f} |"
        )
        if bwd:
            line += f" {r['counted_fwd_bwd']['total']:.2f} |"
        line += f" {r['fixed_fwd_bytes'] / 2**10:.0f} KiB |"
        lines.append(line)
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", default=["small"], help="model presets (configs/model/*.yaml) or bench presets: deep")
    ap.add_argument("--backends", nargs="+", default=BACKENDS, help="residual presets (configs/residual/*.yaml)")
    ap.add_argument("--kernels", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=None, help="override model.n_layers (tests)")
    ap.add_argument("--d-model", dest="d_model", type=int, default=None, help="override model.d_model (tests)")
    ap.add_argument("--no-backward", action="store_true", help="count the forward only")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for config in a.config:
        block = []
        for backend in a.backends:
            name = residual_config(backend, "torch").name
            for kernel in a.kernels if name in DEPTH else ["torch"]:
                row = run_one(config, backend, kernel, a)
                block.append(row)
                print(f"# {config} {backend} {row['kernel']}: {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
        mc = block[0]
        print(
            f"\n## residual_io {datetime.date.today()} config={config} (n_layers={mc['n_layers']}, d_model={mc['d_model']}, "
            f"L={mc['n_branches']} branches) B={a.batch} T={a.seq} {a.dtype}; per token per layer, units of d x {mc['elem_bytes']} B\n"
        )
        print(table(block))
        rows += block
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
