"""MixtureLoader (``data.mixture``): proportions, determinism, DP sharding, exact resume, bad input."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from msar_train.config.schema import DataConfig, MixtureSourceConfig
from msar_train.data.build import build_data
from msar_train.data.loader import Batch, PackedLoader
from msar_train.data.mixture import MixtureLoader, deficit_schedule
from msar_train.data.packed import PackedDataset
from msar_train.data.prepare import PrepareConfig, prepare
from msar_train.errors import InputError

T = 8  # seq_len


def _docs(path: Path, word: str, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} {i} {word}s " * (1 + i % 7)}) + "\n" for i in range(n)), encoding="utf-8")
    return path


def prepare_corpora(root: Path) -> dict[str, Path]:
    """Three prepared dirs under `root`: `a` (alpha text) with its own BPE, `b` (beta text) with a's
    tokenizer, `other` with another BPE (also the integration test's corpora)."""
    common = dict(num_proc=1, progress=False, cache_dir=str(root / "cache"), val_fraction=0.2)
    prepare(PrepareConfig(files=str(_docs(root / "a.jsonl", "alpha", 80)), out_dir=str(root / "a"), vocab_size=280, **common))  # type: ignore[arg-type]
    tok = str(root / "a" / "tokenizer.json")
    prepare(PrepareConfig(files=str(_docs(root / "b.jsonl", "beta", 40)), out_dir=str(root / "b"), tokenizer=tok, **common))  # type: ignore[arg-type]
    prepare(PrepareConfig(files=str(_docs(root / "o.jsonl", "omega", 40)), out_dir=str(root / "other"), vocab_size=270, **common))  # type: ignore[arg-type]
    return {"a": root / "a", "b": root / "b", "other": root / "other"}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return prepare_corpora(tmp_path_factory.mktemp("mixture"))


def _mix(c: dict[str, Path], weights=(0.7, 0.3), split: str = "train", **kw: object) -> MixtureLoader:
    base: dict[str, object] = dict(seq_len=T, micro_batch_size=4, seed=5)
    base.update(kw)
    ds = [PackedDataset(c["a"], split), PackedDataset(c["b"], split)]
    return MixtureLoader(ds, ["a", "b"], list(weights), **base)  # type: ignore[arg-type]


def _same(a: Batch, b: Batch) -> bool:
    return torch.equal(a.input_ids_BT, b.input_ids_BT) and torch.equal(a.labels_BT, b.labels_BT)


def test_counts_stay_within_one_row_of_the_weights() -> None:
    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2, 0.0], [3.0, 1.0, 1.0]):
        p = np.asarray(weights) / sum(weights)
        counts = np.zeros(len(p), dtype=np.int64)
        worst = 0.0
        for n in range(1, 5001):
            deficit_schedule(p, counts, 1)
            worst = max(worst, float(np.abs(counts - p * n).max()))
        assert worst < 1.0, (weights, worst)  # every prefix: |count_s - p_s * N| < 1 row
        assert counts[p == 0].sum() == 0  # a zero weight is never drawn


def test_served_rows_follow_the_weights_and_wrap_without_repeats(corpora: dict[str, Path]) -> None:
    mix = _mix(corpora)
    n_b = mix.num_samples[1]
    seen: dict[int, list[int]] = {0: [], 1: []}
    steps = int(n_b / 1.2) + 5  # b gets 0.3 * 4 = 1.2 rows a step: it wraps into its second epoch
    for _ in range(steps):
        sources, samples = mix.global_rows(mix.step, mix.counts)
        mix.step += 1
        for s, i in zip(sources.tolist(), samples.tolist(), strict=True):
            seen[s].append(i)
    total = steps * 4
    assert abs(len(seen[0]) - 0.7 * total) < 1 and abs(len(seen[1]) - 0.3 * total) < 1
    assert sorted(seen[1][:n_b]) == list(range(n_b))  # b's first epoch: every sample once
    assert seen[1][n_b:] == mix._perm(1, 1)[: len(seen[1]) - n_b].tolist()  # then its epoch-1 permutation
    n_a = mix.num_samples[0]
    assert sorted(seen[0][:n_a]) == list(range(n_a))  # a likewise: each epoch serves every sample once
    assert mix.metrics() == {"data/tokens/a": len(seen[0]) * T, "data/tokens/b": len(seen[1]) * T}


def test_batches_hold_the_drawn_samples(corpora: dict[str, Path]) -> None:
    mix = _mix(corpora)
    sources, samples = mix.global_rows(0, np.zeros(2, dtype=np.int64))
    batch = next(mix)
    for row, (s, i) in enumerate(zip(sources.tolist(), samples.tolist(), strict=True)):
        ds = mix.sources[s].dataset
        assert batch.input_ids_BT[row].tolist() == ds.tokens(i * T, i * T + T).tolist()
        assert batch.labels_BT[row].tolist() == ds.tokens(i * T + 1, i * T + T + 1).tolist()
    assert Counter(sources.tolist()) == {0: 3, 1: 1}  # 4 rows at 0.7 / 0.3: 2.8 / 1.2 -> 3 / 1


def test_order_is_deterministic_and_seeded(corpora: dict[str, Path]) -> None:
    a, b, c = _mix(corpora), _mix(corpora), _mix(corpora, seed=6)
    xs, ys, zs = ([next(m) for _ in range(6)] for m in (a, b, c))
    assert all(_same(x, y) for x, y in zip(xs, ys, strict=True))
    assert not all(_same(x, z) for x, z in zip(xs, zs, strict=True))
    assert _same(_mix(corpora).batch_at(0, 3), xs[3])  # batch_at is the same pure function of the step


def test_dp_ranks_take_disjoint_slices_of_the_world1_batch(corpora: dict[str, Path]) -> None:
    one = _mix(corpora, micro_batch_size=4, world=1)
    ranks = [_mix(corpora, micro_batch_size=2, world=2, rank=r) for r in (0, 1)]
    drawn: set[tuple[int, int]] = set()
    for _ in range(12):
        ref = next(one)
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p.input_ids_BT for p in parts]), ref.input_ids_BT)
        assert torch.equal(torch.cat([p.labels_BT for p in parts]), ref.labels_BT)
    assert [r.state_dict()["counts"] for r in ranks] == [one.state_dict()["counts"]] * 2  # lockstep: rank 0's state serves all
    probe = _mix(corpora, micro_batch_size=2, world=2)
    for step in range(12):  # a source's samples are never shared between the ranks (b has not wrapped)
        sources, samples = probe.global_rows(step, probe.counts)
        for r in (0, 1):
            mine = set(zip(sources[2 * r : 2 * r + 2].tolist(), samples[2 * r : 2 * r + 2].tolist(), strict=True))
            assert not mine & drawn
            drawn |= mine


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_resume_continues_exactly(corpora: dict[str, Path], world: int, rank: int) -> None:
    ref = _mix(corpora, world=world, rank=rank, micro_batch_size=2)
    for _ in range(ref.num_samples[1] // 2):  # past b's first epoch boundary soon after
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))  # must survive a JSON checkpoint
    tokens = ref.metrics()
    expected = [next(ref) for _ in range(9)]
    resumed = _mix(corpora, world=world, rank=rank, micro_batch_size=2)
    resumed.load_state_dict(state)
    assert resumed.metrics() == tokens  # the token counts come back with the state
    got = [next(resumed) for _ in range(9)]
    assert all(_same(x, y) for x, y in zip(expected, got, strict=True))
    assert resumed.state_dict() == ref.state_dict()


def test_resume_refuses_another_order(corpora: dict[str, Path]) -> None:
    mix = _mix(corpora)
    next(mix)
    state = mix.state_dict()
    with pytest.raises(ValueError, match="weights"):
        _mix(corpora, weights=(0.5, 0.5)).load_state_dict(state)
    with pytest.raises(ValueError, match="rows=4"):
        _mix(corpora, micro_batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="single-source"):
        mix.load_state_dict(PackedLoader(PackedDataset(corpora["a"]), T, 4).state_dict())
    with pytest.raises(ValueError, match="data.mixture run"):
        PackedLoader(PackedDataset(corpora["a"]), T, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="inconsistent"):
        mix.load_state_dict({**state, "counts": [9, 9]})


@pytest.mark.parametrize("old,new", [((4, 1), (2, 1)), ((2, 2), (8, 1)), ((2, 1), (3, 2))])
def test_relayout_moves_the_position_over_global_rows(corpora: dict[str, Path], old: tuple, new: tuple) -> None:
    """(B, W) -> (B', W'): after `step * R` rows the resumed loader serves what an uninterrupted
    run under the new layout serves from that row on (the counts depend on the rows drawn only)."""
    (b0, w0), (b1, w1) = old, new
    rows = 24  # a multiple of every R here (4, 2, 8, 6)
    src = _mix(corpora, micro_batch_size=b0, world=w0)
    for _ in range(rows // (b0 * w0)):
        next(src)
    state = json.loads(json.dumps(src.state_dict()))
    for r in range(w1):
        resumed = _mix(corpora, micro_batch_size=b1, world=w1, rank=r)
        resumed.load_state_dict(state, relayout=True)
        fresh = _mix(corpora, micro_batch_size=b1, world=w1, rank=r)
        for _ in range(rows // (b1 * w1)):
            next(fresh)
        assert resumed.state_dict() == fresh.state_dict() and resumed.metrics() == src.metrics()
        assert all(_same(next(resumed), next(fresh)) for _ in range(5))


def test_relayout_refuses_a_position_the_new_rows_do_not_divide(corpora: dict[str, Path]) -> None:
    mix = _mix(corpora, micro_batch_size=2, world=1)
    for _ in range(3):  # 6 rows
        next(mix)
    state = mix.state_dict()
    with pytest.raises(ValueError, match=r"parallel.micro_batch_size=2 x 2 data-parallel ranks = 4"):
        _mix(corpora, micro_batch_size=2, world=2).load_state_dict(state, relayout=True)
    with pytest.raises(ValueError, match="rows=2"):  # without relayout another R is refused outright
        _mix(corpora, micro_batch_size=3, world=2).load_state_dict(state)
    same = _mix(corpora, micro_batch_size=1, world=2)  # R unchanged: exact, relayout or not
    same.load_state_dict(state, relayout=True)
    assert same.step == 3


def test_eval_mixture_is_fixed(corpora: dict[str, Path]) -> None:
    val = _mix(corpora, split="validation", shuffle=False, micro_batch_size=2)
    a, b = list(val.batches(3)), list(val.batches(3))
    assert len(a) == 3 and all(_same(x, y) for x, y in zip(a, b, strict=True))
    assert val.state_dict()["step"] == 0  # batches() does not move the loader
    assert len(list(val.batches(10**6))) == len(val)


def _data(*sources: MixtureSourceConfig, **kw: object) -> DataConfig:
    return DataConfig(mixture=list(sources), seq_len=T, **kw)  # type: ignore[arg-type]


def test_build_data_mixture_bundle(corpora: dict[str, Path]) -> None:
    bundle = build_data(_data(MixtureSourceConfig(str(corpora["a"]), 0.7), MixtureSourceConfig(str(corpora["b"]), 0.3, "beta")), 512, 1, 2)
    assert isinstance(bundle.train, MixtureLoader) and isinstance(bundle.val, MixtureLoader) and bundle.test is None
    assert bundle.train.names == ["a", "beta"] and bundle.val.shuffle is False
    assert bundle.meta["tokenizer_sha256"] == PackedDataset(corpora["b"]).meta["tokenizer_sha256"]
    assert set(next(bundle.train) and bundle.train.metrics()) == {"data/tokens/a", "data/tokens/beta"}


def _fails(match: str, cfg: DataConfig) -> None:
    with pytest.raises(InputError) as err:
        build_data(cfg, 512, 1, 2)
    assert match in str(err.value), str(err.value)


def test_bad_mixtures_name_the_field(corpora: dict[str, Path], tmp_path: Path) -> None:
    a, b, other = (str(corpora[k]) for k in ("a", "b", "other"))
    _fails("data.mixture[*].weight=[0.0, 0.0]: the weights must sum to a positive number",
           _data(MixtureSourceConfig(a, 0.0), MixtureSourceConfig(b, 0.0)))  # fmt: skip
    _fails("data.mixture[1].weight=-1.0: must be >= 0", _data(MixtureSourceConfig(a, 1.0), MixtureSourceConfig(b, -1.0)))
    _fails("data.mixture[0].path=None", _data(MixtureSourceConfig(None, 1.0)))
    _fails(f"data.mixture[1].path={tmp_path / 'nope'}: not a directory",
           _data(MixtureSourceConfig(a), MixtureSourceConfig(str(tmp_path / "nope"))))  # fmt: skip
    half = tmp_path / "half"
    shutil.copytree(corpora["b"], half)
    (half / "meta.json").unlink()
    _fails(f"data.mixture[1].path={half}: {half / 'meta.json'} not found", _data(MixtureSourceConfig(a), MixtureSourceConfig(str(half))))
    _fails(f"data.mixture[1].path={other}: tokenized with tokenizer sha256",
           _data(MixtureSourceConfig(a), MixtureSourceConfig(other)))  # fmt: skip
    with pytest.raises(InputError, match=rf"but data.mixture\[0\].path={a} with"):
        build_data(_data(MixtureSourceConfig(a), MixtureSourceConfig(other)), 512, 1, 2)
    twin = tmp_path / "x" / "a"
    shutil.copytree(corpora["a"], twin)
    _fails("data.mixture[1].name='a': is also the name of data.mixture[0]",
           _data(MixtureSourceConfig(a), MixtureSourceConfig(str(twin))))  # fmt: skip
    _fails("data.path='/somewhere': must be null when data.mixture is given", _data(MixtureSourceConfig(a), path="/somewhere"))


def test_compose_refuses_a_negative_weight_naming_the_entry() -> None:
    from msar_train.config.compose import compose_config

    with pytest.raises(ValueError, match=r"data\.mixture\[1\]\.weight=-1\.0: must be >= 0"):
        compose_config(["data.mixture=[{path: /a, weight: 0.7}, {path: /b, weight: -1}]"])
    cfg = compose_config(["data.mixture=[{path: /x/a, weight: 0.7}, {path: /y/b, weight: 0.3, name: web}]"])
    assert [(s.path, s.weight, s.name) for s in cfg.data.mixture] == [("/x/a", 0.7, None), ("/y/b", 0.3, "web")]
    assert list(compose_config([]).data.mixture) == []  # default: no mixture, the single-source path
