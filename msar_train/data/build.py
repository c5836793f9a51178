"""`build_data`: a `DataConfig` -> ready-to-iterate train / validation loaders (`DataBundle`).

With ``data.path`` null the built-in ``data.corpus`` is prepared once with a trained byte-level
BPE of ``data.tokenizer_vocab_size`` into ``<cache_dir>/prepared/<corpus>-bpe<vocab>`` and reused
while its meta.json matches the request (a file lock keeps concurrent ranks on one node from
preparing twice). Otherwise ``data.path`` must be a directory made by ``msar-prepare-data``.
A non-empty ``data.mixture`` replaces both: its prepared dirs are mixed by `MixtureLoader`
(``mixture.py``), validation and test being the same fixed mixture of their splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf.errors import MissingMandatoryValue

from msar_train.data.corpora import BUILTIN_CORPORA
from msar_train.data.io import file_lock, read_json, resolve_cache_dir
from msar_train.data.loader import PackedDataset, PackedLoader
from msar_train.data.mixture import MixtureLoader, open_mixture
from msar_train.data.prepare import FORMAT_VERSION, PrepareConfig, prepare


@dataclass
class DataBundle:
    """What the trainer needs from the data side.

    `train` shuffles (per-epoch permutation, rank-sharded); `val` and `test` keep a fixed order
    (``val.batches(n)`` = the same first n batches every call) and are None when the prepared data
    has no such split. `vocab_size` is the tokenizer's (<= the model's); `meta` is meta.json.
    """

    train: PackedLoader | MixtureLoader
    val: PackedLoader | MixtureLoader | None
    vocab_size: int
    meta: dict[str, Any]
    path: Path
    eos_id: int = 0
    test: PackedLoader | MixtureLoader | None = None


def _field(cfg: Any, name: str, default: Any) -> Any:
    """Read a field from a DataConfig dataclass or an OmegaConf DictConfig alike."""
    try:
        value = getattr(cfg, name, default)
    except MissingMandatoryValue:  # a DictConfig field left at '???'
        return "???"
    return default if value is None and default is not None else value


def prepared_dir(corpus: str, vocab_size: int, cache_dir: Path) -> Path:
    """Where `build_data` keeps built-in corpus `corpus` tokenized with a BPE of `vocab_size`."""
    return cache_dir / "prepared" / f"{corpus}-bpe{vocab_size}"


def ensure_prepared(
    corpus: str, vocab_size: int, cache_dir: Path, val_fraction: float = 0.05, num_proc: int = 2, progress: bool = True
) -> Path:
    """Prepare built-in `corpus` into `prepared_dir(...)` unless a matching preparation exists."""
    if corpus not in BUILTIN_CORPORA:
        raise ValueError(
            f"data.corpus={corpus!r} is not a built-in corpus {BUILTIN_CORPORA}; prepare it with "
            "msar-prepare-data and set data.path to the output dir"
        )
    out = prepared_dir(corpus, vocab_size, cache_dir)
    with file_lock(out.parent / f".{out.name}.lock"):
        if _matches(out, corpus, vocab_size, val_fraction):
            return out
        cfg = PrepareConfig(
            corpus=corpus, out_dir=str(out), vocab_size=vocab_size, val_fraction=val_fraction,
            num_proc=num_proc, cache_dir=str(cache_dir), overwrite=True, progress=progress,
        )  # fmt: skip
        prepare(cfg)
    return out


def _matches(out: Path, corpus: str, vocab_size: int, val_fraction: float) -> bool:
    """True when `out/meta.json` records exactly the preparation `ensure_prepared` would make."""
    try:
        meta = read_json(out / "meta.json", "meta")
    except (FileNotFoundError, ValueError):
        return False
    src, tok = meta.get("source", {}), meta.get("tokenizer_source", {})
    return (
        meta.get("format_version") == FORMAT_VERSION
        and src.get("kind") == "builtin"
        and src.get("corpus") == corpus
        and src.get("val_fraction") == val_fraction
        and src.get("split_seed") == PrepareConfig.split_seed
        and tok.get("kind") == "bpe"
        and tok.get("vocab_size") == vocab_size
        and tok.get("min_frequency") == PrepareConfig.min_frequency
        and tok.get("train_docs") is None
    )


def build_data(data_cfg: Any, model_vocab_size: int, seed: int, micro_batch_size: int, rank: int = 0, world: int = 1) -> DataBundle:
    """Open (preparing first if needed) the data described by `data_cfg` (a `DataConfig`).

    Raises ValueError naming the field when the tokenizer vocab exceeds `model_vocab_size`
    (checked before any preparation when the vocab is known up front).
    """
    mixture = _field(data_cfg, "mixture", None)
    if mixture:
        return _build_mixture(data_cfg, mixture, model_vocab_size, seed, micro_batch_size, rank, world)
    path = _field(data_cfg, "path", None)
    verify = bool(_field(data_cfg, "verify_checksums", True))
    corpus = str(_field(data_cfg, "corpus", "shakespeare"))
    if path in ("???", "") or (path is None and corpus == "custom"):
        raise ValueError("data.path is required (set it to a dir made by msar-prepare-data)")
    if path is None:
        vocab = int(_field(data_cfg, "tokenizer_vocab_size", 4096))
        if vocab > model_vocab_size:
            raise ValueError(f"data.tokenizer_vocab_size={vocab} exceeds the model vocab (model.vocab_size={model_vocab_size})")
        cache = resolve_cache_dir(_field(data_cfg, "cache_dir", None))
        val_fraction = float(_field(data_cfg, "val_fraction", 0.05))
        num_proc = int(_field(data_cfg, "num_proc", 2))
        root = ensure_prepared(corpus, vocab, cache, val_fraction, num_proc, progress=rank == 0)
    else:
        root = Path(str(path)).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"data.path={root} is not a directory")
    expected = _field(data_cfg, "expected_tokenizer_sha256", None)
    train_ds = PackedDataset(root, "train", verify_checksums=verify, expected_tokenizer_sha256=expected)
    if train_ds.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer of {root} has {train_ds.vocab_size} tokens, more than the model vocab (model.vocab_size={model_vocab_size})"
        )
    seq_len = int(_field(data_cfg, "seq_len", 128))
    doc_mask = bool(_field(data_cfg, "document_mask", False))
    common = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, rank=rank, world=world,
                  document_mask=doc_mask)  # fmt: skip
    train = PackedLoader(train_ds, shuffle=True, **common)  # type: ignore[arg-type]

    def fixed(split: str) -> PackedLoader | None:
        if split not in train_ds.meta["splits"]:
            return None
        ds = PackedDataset(root, split, verify_checksums=verify, expected_tokenizer_sha256=expected)
        return PackedLoader(ds, shuffle=False, **common)  # type: ignore[arg-type]

    return DataBundle(
        train=train, val=fixed("validation"), vocab_size=train_ds.vocab_size, meta=train_ds.meta,
        path=root, eos_id=train_ds.eos_id, test=fixed("test"),
    )  # fmt: skip


def _build_mixture(
    data_cfg: Any, mixture: Any, model_vocab_size: int, seed: int, micro_batch_size: int, rank: int, world: int
) -> DataBundle:
    """`build_data` for a non-empty ``data.mixture`` (checks in `open_mixture`)."""
    opts = dict(verify_checksums=bool(_field(data_cfg, "verify_checksums", True)),
                expected_tokenizer_sha256=_field(data_cfg, "expected_tokenizer_sha256", None))  # fmt: skip
    path = _field(data_cfg, "path", None)
    opened = open_mixture(mixture, path, "train", **opts)  # type: ignore[arg-type]
    assert opened is not None  # every prepared dir has a train split (PackedDataset checks)
    names, weights, train_ds = opened
    first = train_ds[0]
    if first.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer of data.mixture[0].path={first.path} has {first.vocab_size} tokens, more than the model vocab "
            f"(model.vocab_size={model_vocab_size})"
        )
    common = dict(seq_len=int(_field(data_cfg, "seq_len", 128)), micro_batch_size=micro_batch_size, seed=seed, rank=rank,
                  world=world, document_mask=bool(_field(data_cfg, "document_mask", False)))  # fmt: skip

    def fixed(split: str) -> MixtureLoader | None:
        got = open_mixture(mixture, path, split, **opts)  # type: ignore[arg-type]
        return None if got is None else MixtureLoader(got[2], got[0], got[1], shuffle=False, **common)  # type: ignore[arg-type]

    return DataBundle(
        train=MixtureLoader(train_ds, names, weights, shuffle=True, **common),  # type: ignore[arg-type]
        val=fixed("validation"), vocab_size=first.vocab_size, meta=first.meta, path=first.path, eos_id=first.eos_id,
        test=fixed("test"),
    )  # fmt: skip
