"""Incremental decoding (``Transformer.decode`` + ``DecodeCache``) against the full forward.

Reference: one ``Transformer.forward`` over the whole sequence. Decoding: a prefill of ``k`` tokens,
then one token at a time (and, once, a chunk of several), through the cache. The logits must agree at
every position: fp64 within 1e-10, fp32 within 1e-5 relative, for every residual preset, with and
without document masking, and with the Triton kernel (interpreted on the CPU) where it applies.
Left padding: a padded row's logits at its real positions equal the row decoded alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from msar_train.config import compose_config
from msar_train.model.cache import DecodeCache
from msar_train.model.transformer import Transformer
from tests.unit.export_helpers import tiny_overrides
from tests.unit.helpers import perturb_residual

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" / "residual").glob("*.yaml"))


def build(residual: str, dtype=torch.float64, document_mask: bool = False, kernel: str | None = None, **over) -> Transformer:
    extra = [f"residual.kernel={kernel}"] if kernel else []
    cfg = compose_config([*tiny_overrides(residual, **over), *extra])
    model = Transformer(cfg.model, cfg.residual, document_mask=document_mask, seed=1)
    perturb_residual(model, seed=5, scale=0.3)  # every residual parameter matters
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.expert_bias.normal_(0, 0.05)
    return model.to(dtype).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def incremental(model: Transformer, ids_BT: torch.Tensor, prefill: int, chunk_at: int | None = None, **kw) -> torch.Tensor:
    """Logits of every position, decoded as prefill + single tokens (+ one 3-token chunk at ``chunk_at``)."""
    cache, out, t = DecodeCache(), [], 0
    T = ids_BT.shape[1]
    steps = [prefill]
    while sum(steps) < T:
        steps.append(3 if sum(steps) == chunk_at else 1)
    with torch.no_grad():
        for n in steps:
            n = min(n, T - t)
            sl = slice(t, t + n)
            extra = {k: v[:, sl] for k, v in kw.items()}
            out.append(model.decode(ids_BT[:, sl], cache, **extra)[0])
            t += n
    assert cache.get_seq_length() == T
    return torch.cat(out, 1)


@pytest.mark.parametrize("residual", PRESETS)
def test_incremental_equals_full_fp64(residual):
    model = build(residual)
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(ids)
    inc = incremental(model, ids, prefill=5, chunk_at=9)
    assert rel_err(inc, full) < 1e-10, residual


@pytest.mark.parametrize("residual", ["vanilla", "mhc", "attnres", "msar", "msar_full", "msar_b2"])
def test_incremental_equals_full_fp32(residual):
    model = build(residual, torch.float32)
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(ids)
    # prefill shorter than the conv reach (11): the history grows through its start
    inc = incremental(model, ids, prefill=3)
    assert rel_err(inc, full) < 1e-5, residual


@pytest.mark.parametrize("residual", ["msar", "attnres", "mhc"])
def test_incremental_with_document_mask(residual):
    """Packed documents: positions restart and neither attention nor a conv crosses a boundary."""
    model = build(residual, document_mask=True)
    ids = torch.randint(0, 320, (2, 18), generator=torch.Generator().manual_seed(2))
    doc = torch.tensor([[0] * 7 + [1] * 11, [0] * 12 + [1] * 6])
    pos = torch.cat([torch.arange(7), torch.arange(11)]).expand(2, 18).clone()
    pos[1] = torch.cat([torch.arange(12), torch.arange(6)])
    with torch.no_grad():
        full, _ = model(ids, doc, pos)
    inc = incremental(model, ids, prefill=4, doc_ids_BT=doc, positions_BT=pos)
    assert rel_err(inc, full) < 1e-10


def _left_padded(model, prompts: list[torch.Tensor], pad_id: int = 0):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = p, 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    return ids, mask, pos


@pytest.mark.parametrize("residual", ["msar", "msar_b2", "attnres", "mhc", "vanilla"])
def test_left_padding_equals_alone(residual):
    """Padding is a document of its own (doc id 0, real tokens 1): nothing leaks into real tokens."""
    model = build(residual)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 320, (n,), generator=g) for n in (15, 6, 10)]
    ids, mask, pos = _left_padded(model, prompts)
    batched = incremental(model, ids, prefill=4, doc_ids_BT=mask, positions_BT=pos)
    for i, p in enumerate(prompts):
        alone = incremental(model, p.unsqueeze(0), prefill=2)
        assert rel_err(batched[i, -len(p) :], alone[0]) < 1e-10, (residual, i)


@pytest.mark.parametrize("residual", ["msar", "msar_b2"])
def test_incremental_with_triton_kernel(residual, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build(residual, torch.float32, kernel="triton")
    ref = build(residual, torch.float32)
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 320, (1, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full_triton, _ = model(ids)
        full_torch, _ = ref(ids)
    inc = incremental(model, ids, prefill=4)
    assert rel_err(inc, full_triton) < 1e-5
    assert rel_err(inc, full_torch) < 1e-5


def test_cache_holds_conv_history_and_kv():
    """What the cache keeps: per attention K and V of every token; per MSAR source its last
    max(kernel_sizes) - 1 positions; nothing per source for a backend without convolutions."""
    ids = torch.randint(0, 320, (2, 20))
    for residual, n_sources in (("msar", None), ("attnres", 0), ("mhc", 0), ("vanilla", 0)):
        model = build(residual)
        cache = DecodeCache()
        with torch.no_grad():
            model.decode(ids, cache)
        kv = [v for k, v in cache.tensors.items() if k[1] in ("k", "v")]
        src = {k: v for k, v in cache.tensors.items() if k[0] == "msar_source"}
        assert len(kv) == 2 * len(model.blocks) and all(v.shape[2] == 20 for v in kv)
        if n_sources is None:
            reach = max(model.backend.kernel_sizes) - 1
            lay = model.backend.layout
            partials = sum(1 for b in range(1, lay.n_branches + 1) if not lay.is_first(b))
            assert len(src) == lay.n_blocks + 1 + partials
            assert all(v.shape == (2, reach, 16) for v in src.values())
        else:
            assert not src


def test_cache_reorder_and_errors():
    model = build("msar")
    ids = torch.randint(0, 320, (3, 8))
    cache = DecodeCache()
    with torch.no_grad():
        model.decode(ids, cache)
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        step = torch.randint(0, 320, (3, 1))
        got = model.decode(step, cache)[0]
        with pytest.raises(ValueError, match="holds 3 sequences"):
            model.decode(step[:2], cache)
        ref_cache = DecodeCache()
        model.decode(ids[[2, 2, 0]], ref_cache)
        want = model.decode(step, ref_cache)[0]
    assert rel_err(got, want) < 1e-12
    assert cache.get_seq_length() == 9  # the refused forward changed nothing
