"""PackedLoader: packing, rank sharding, epoch shuffling, exact resume, document mask."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from msar_train.data.loader import Batch, PackedLoader, document_ids_and_positions
from msar_train.data.packed import PackedDataset
from msar_train.data.prepare import PrepareConfig, prepare

T = 16  # seq_len


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~40 short documents of varying length, tokenized with a tiny BPE (train split only)."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "ζeta", "日本", "🙂"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(60)]
    f = root / "c.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    cfg = PrepareConfig(files=str(f), out_dir=str(root / "out"), vocab_size=280, num_proc=1, progress=False,
                        cache_dir=str(root / "cache"), val_fraction=0.0, shard_tokens=97)  # fmt: skip
    prepare(cfg)
    return root / "out"


def _loader(path: Path, **kw: object) -> PackedLoader:
    base: dict[str, object] = dict(seq_len=T, micro_batch_size=3, seed=7)
    base.update(kw)
    return PackedLoader(PackedDataset(path), **base)  # type: ignore[arg-type]


def _same(a: Batch, b: Batch) -> bool:
    return torch.equal(a.input_ids_BT, b.input_ids_BT) and torch.equal(a.labels_BT, b.labels_BT)


def test_samples_are_packed_windows(prepared: Path) -> None:
    loader = _loader(prepared)
    ds = loader.dataset
    stream = ds.tokens(0, ds.num_tokens).astype(np.int64)
    assert loader.num_samples == (ds.num_tokens - 1) // T
    ids = loader.rank_samples(0)[:3]
    batch = next(loader)
    assert batch.input_ids_BT.dtype == torch.int64 and batch.input_ids_BT.shape == (3, T)
    for b, i in enumerate(ids):
        assert batch.input_ids_BT[b].tolist() == stream[i * T : i * T + T].tolist()
        assert batch.labels_BT[b].tolist() == stream[i * T + 1 : i * T + T + 1].tolist()
    assert batch.doc_ids_BT is None and batch.positions_BT is None


def test_two_ranks_cover_an_epoch_without_overlap(prepared: Path) -> None:
    r0, r1 = _loader(prepared, rank=0, world=2), _loader(prepared, rank=1, world=2)
    s0, s1 = set(r0.rank_samples(0).tolist()), set(r1.rank_samples(0).tolist())
    n = r0.num_samples
    assert not s0 & s1
    assert len(s0) == len(s1) == n // 2 and len(s0 | s1) == (n // 2) * 2
    assert len(r0) == len(r1) == (n // 2) // 3
    # the batches served are exactly those samples, in order
    served = torch.cat([b.input_ids_BT for b in r1.batches()])
    expect = [r1.dataset.tokens(i * T, i * T + T).tolist() for i in r1.rank_samples(0)[: len(r1) * 3]]
    assert served.tolist() == expect


def test_order_depends_on_seed_and_epoch_only(prepared: Path) -> None:
    a, b = _loader(prepared), _loader(prepared)
    assert np.array_equal(a.rank_samples(0), b.rank_samples(0))
    assert all(_same(x, y) for x, y in zip(a.batches(5), b.batches(5)))
    assert not np.array_equal(a.rank_samples(0), a.rank_samples(1))
    assert sorted(a.rank_samples(0)) == sorted(a.rank_samples(1))  # a reshuffle of the same samples
    assert not np.array_equal(a.rank_samples(0), _loader(prepared, seed=8).rank_samples(0))
    fixed = _loader(prepared, shuffle=False)
    assert fixed.rank_samples(3).tolist() == list(range(len(fixed.rank_samples(0))))


def test_epochs_advance_and_reshuffle(prepared: Path) -> None:
    loader = _loader(prepared)
    steps = len(loader)
    first = [next(loader) for _ in range(steps)]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["index"] == 0
    second = next(loader)
    assert _same(second, loader.batch_at(1, 0)) and not _same(second, first[0])


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_resume_matches_uninterrupted_run_across_epoch_boundary(prepared: Path, world: int, rank: int) -> None:
    ref = _loader(prepared, world=world, rank=rank)
    k = len(ref) - 2  # stop two batches before the epoch ends
    for _ in range(k):
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))  # must survive a JSON checkpoint
    expected = [next(ref) for _ in range(5)]  # crosses into epoch 1
    resumed = _loader(prepared, world=world, rank=rank)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(5)]
    assert all(_same(x, y) for x, y in zip(expected, got))
    assert resumed.state_dict() == ref.state_dict()


def test_resume_rejects_other_order(prepared: Path) -> None:
    state = _loader(prepared, world=2).state_dict()
    with pytest.raises(ValueError, match="world=2"):
        _loader(prepared, world=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=7"):
        _loader(prepared, world=2, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="micro_batch_size"):
        _loader(prepared, world=2, micro_batch_size=2).load_state_dict(state)


def test_relayout_continues_after_the_consumed_prefix(prepared: Path) -> None:
    """World 2 x micro 3 for 2 steps took the first 12 samples of the epoch; world 3 x micro 2 (and
    world 1 x micro 4 ... any B * w dividing 12) continues with samples 12, 13, ... of the same order."""
    old = [_loader(prepared, world=2, rank=r) for r in range(2)]
    for _ in range(2):
        for ld in old:
            next(ld)
    state = json.loads(json.dumps(old[0].state_dict()))
    for world, micro in ((3, 2), (1, 4), (4, 3), (6, 1)):
        new = [_loader(prepared, world=world, rank=r, micro_batch_size=micro) for r in range(world)]
        for ld in new:
            ld.load_state_dict(state, relayout=True)
        taken = sorted(int(x) for ld in new for x in ld.rank_samples(0)[ld.index * micro : (ld.index + 1) * micro])
        # the reference: an uninterrupted world-1 loader's samples 12 .. 12 + world * micro of epoch 0
        order = _loader(prepared, world=1, micro_batch_size=1).rank_samples(0)
        assert taken == sorted(int(x) for x in order[12 : 12 + world * micro]), (world, micro)
        first = next(new[0])
        assert _same(first, new[0].batch_at(0, 12 // (world * micro)))


def test_relayout_refuses_a_position_that_cannot_continue(prepared: Path) -> None:
    old = _loader(prepared, world=2)
    next(old)  # 6 samples consumed
    with pytest.raises(ValueError, match=r"parallel.micro_batch_size=4 x 1 data-parallel ranks = 4"):
        _loader(prepared, world=1, micro_batch_size=4).load_state_dict(old.state_dict(), relayout=True)
    with pytest.raises(ValueError, match="seed=7"):  # the order itself must still be the same
        _loader(prepared, world=1, micro_batch_size=2, seed=9).load_state_dict(old.state_dict(), relayout=True)


def test_too_small_for_one_batch(prepared: Path) -> None:
    with pytest.raises(ValueError, match="micro_batch_size=1000"):
        _loader(prepared, micro_batch_size=1000)
    with pytest.raises(ValueError, match="rank=2"):
        _loader(prepared, rank=2, world=2)


def test_document_mask_follows_eos(prepared: Path) -> None:
    loader = _loader(prepared, document_mask=True, micro_batch_size=8)
    eos = loader.dataset.eos_id
    for batch in loader.batches(10):
        assert batch.doc_ids_BT is not None and batch.positions_BT is not None
        assert batch.doc_ids_BT.dtype == torch.int64 and batch.positions_BT.shape == batch.input_ids_BT.shape
        for x, d, p in zip(batch.input_ids_BT.tolist(), batch.doc_ids_BT.tolist(), batch.positions_BT.tolist()):
            doc, pos = 0, 0
            for t in range(T):
                if t > 0 and x[t - 1] == eos:  # a new document starts right after EOS, nowhere else
                    doc, pos = doc + 1, 0
                assert (d[t], p[t]) == (doc, pos)
                pos += 1


def test_document_ids_and_positions_small_example() -> None:
    x = np.array([[5, 0, 6, 7, 0, 0, 8], [0, 9, 9, 9, 9, 9, 9]])
    doc, pos = document_ids_and_positions(x, eos_id=0)
    assert doc.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_eval_batches_are_fixed(prepared: Path) -> None:
    val = _loader(prepared, shuffle=False)
    a, b = list(val.batches(4)), list(val.batches(4))
    assert len(a) == 4 and all(_same(x, y) for x, y in zip(a, b))
    assert len(list(val.batches(10**6))) == len(val)
    assert val.state_dict()["index"] == 0  # batches() does not move the loader
