"""``msar-prepare-data``: corpus -> tokenizer -> token shards + document index + meta.json.

Usage (Hydra-override-like ``key=value`` arguments)::

    msar-prepare-data corpus=shakespeare out_dir=data/shk vocab_size=4096
    msar-prepare-data corpus=ptb out_dir=data/ptb tokenizer=path/to/tokenizer.json
    msar-prepare-data corpus=files files='corpus/*.jsonl' format=json text_field=text out_dir=data/x
    msar-prepare-data corpus=hf hf_name=roneneldan/TinyStories streaming=true out_dir=data/ts

Output (`out_dir`): ``tokenizer.json``; per split ``<split>_NNNNNN.bin`` shards and
``<split>_docs.npy`` (layout in `shards.py`); ``meta.json`` written last, so a directory with a
meta.json is complete. Every file is written atomically. Nothing is written before the tokenizer
exists and has passed the `model_vocab_size` check. Fields: see `PrepareConfig`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msar_train.data import corpora, shards, sources
from msar_train.data import tokenizer as tokmod
from msar_train.data.io import atomic_write_bytes, atomic_write_json, resolve_cache_dir

FORMAT_VERSION = 1
CORPORA = ("shakespeare", "ptb", "files", "hf")
_SHARD_RE = re.compile(r"^(train|validation|test)_\d{6}\.bin$")


@dataclass
class PrepareConfig:
    """Arguments of `prepare` / the CLI (same names)."""

    corpus: str | None = None  # shakespeare | ptb | files | hf (default files when files= is given)
    out_dir: str | None = None
    files: str | None = None  # comma-separated files / folders / globs (train, or all splits)
    val_files: str | None = None  # explicit validation files (then val_fraction is not used)
    test_files: str | None = None
    format: str | None = None  # text | json | parquet; default: from the file extensions
    text_field: str = "text"  # json / parquet / hf column holding the document
    sample_by: str = "document"  # text files: document (one per file) | paragraph (blank lines) | line
    hf_name: str | None = None
    hf_config: str | None = None
    streaming: bool = False
    tokenizer: str | None = None  # tokenizer.json, HF tokenizer folder, or encoder.json+vocab.bpe folder
    vocab_size: int = 4096  # trained byte-level BPE size (when no tokenizer is given)
    min_frequency: int = 2  # BPE: merges need a pair seen at least this often
    tokenizer_train_docs: int | None = None  # train the BPE on at most this many train documents
    eos_token: str | None = None  # default: <|endoftext|> or another usual EOS spelling
    val_fraction: float = 0.05  # carve validation off train (by documents) when there is none
    split_seed: int = 0
    num_proc: int = 2
    model_vocab_size: int | None = None  # fail (before writing) if the tokenizer is larger
    shard_tokens: int = 1 << 28  # tokens per shard file (512 MiB of uint16)
    cache_dir: str | None = None  # built-in corpora + datasets cache; default MSAR_CACHE / .cache/msar
    overwrite: bool = False  # replace an existing preparation in out_dir
    progress: bool = True


def prepare(cfg: PrepareConfig) -> dict[str, Any]:
    """Run the whole preparation; return the meta dict that was written to ``out_dir/meta.json``."""
    t0 = time.perf_counter()
    corpus = _check(cfg)
    out = Path(cfg.out_dir).expanduser()  # type: ignore[arg-type]
    if (out / "meta.json").exists() and not cfg.overwrite:
        raise ValueError(f"out_dir={out} already holds a prepared dataset (meta.json); pass overwrite=true")
    cache = resolve_cache_dir(cfg.cache_dir)
    log = _logger(cfg.progress)

    log(f"reading corpus={corpus}")
    source = _source(cfg, corpus, cache)
    if next(source.train_texts(), None) is None:
        raise ValueError(f"input is empty: no non-empty train documents in {_describe(source)}")
    tok, tok_desc, train_s = _tokenizer(cfg, source, log)
    vocab = tokmod.vocab_size(tok)
    if cfg.model_vocab_size is not None and vocab > cfg.model_vocab_size:
        raise ValueError(
            f"tokenizer vocab size {vocab} exceeds model_vocab_size={cfg.model_vocab_size} "
            f"({tok_desc}); use a smaller vocab_size or a bigger model vocab"
        )
    eos_token, eos_id = tokmod.find_eos(tok, cfg.eos_token)
    dtype = shards.token_dtype(vocab)

    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # the old preparation is invalid from here on
    writers = {s: shards.ShardWriter(out, s, dtype, cfg.shard_tokens) for s in sources.SPLITS}
    t1 = time.perf_counter()
    try:
        with _progress(cfg.progress, source.num_documents) as advance:
            shards.encode_documents(tok, source.documents(), writers, eos_id, cfg.num_proc, advance)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    encode_s = time.perf_counter() - t1
    if writers["train"].num_tokens == 0:
        raise ValueError(f"input is empty: no non-empty train documents in {_describe(source)}")
    splits = {s: w.finish() for s, w in writers.items() if w.num_tokens > 0}

    tok_bytes = tokmod.tokenizer_bytes(tok)
    atomic_write_bytes(out / "tokenizer.json", tok_bytes)
    _remove_stale(out, splits)
    n_tok = sum(s["num_tokens"] for s in splits.values())
    meta = {
        "format_version": FORMAT_VERSION,
        "vocab_size": vocab,
        "dtype": dtype.name,
        "eos_id": eos_id,
        "eos_token": eos_token,
        "pad_id": tokmod.pad_id(tok),
        "tokenizer_file": "tokenizer.json",
        "tokenizer_sha256": _sha256(tok_bytes),
        "tokenizer_source": tok_desc,
        "source": {**source.description, "val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed},
        "splits": splits,
        "stats": {
            "tokenizer_train_s": round(train_s, 3),
            "encode_s": round(encode_s, 3),
            "total_s": round(time.perf_counter() - t0, 3),
            "tokens_per_s": round(n_tok / max(encode_s, 1e-9)),
            "num_proc": cfg.num_proc,
        },
    }
    atomic_write_json(out / "meta.json", meta)  # last: its presence marks a complete preparation
    log(f"wrote {out}: " + ", ".join(f"{k} {v['num_tokens']:,} tokens" for k, v in splits.items()))
    return meta


def _check(cfg: PrepareConfig) -> str:
    """Validate fields that need no I/O; return the effective corpus name."""
    corpus = cfg.corpus or ("files" if cfg.files else None)
    if corpus not in CORPORA:
        raise ValueError(f"corpus={cfg.corpus!r}: choose one of {CORPORA}")
    if not cfg.out_dir:
        raise ValueError("out_dir= is required (the directory to write the prepared data to)")
    if corpus == "files" and not cfg.files:
        raise ValueError("corpus=files needs files=PATH_OR_GLOB[,...]")
    if corpus == "hf" and not cfg.hf_name:
        raise ValueError("corpus=hf needs hf_name=<dataset name>")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ValueError(f"val_fraction={cfg.val_fraction} must be in [0, 1)")
    if cfg.num_proc < 1:
        raise ValueError(f"num_proc={cfg.num_proc} must be >= 1")
    if cfg.tokenizer_train_docs is not None and cfg.tokenizer_train_docs < 1:
        raise ValueError(f"tokenizer_train_docs={cfg.tokenizer_train_docs} must be >= 1 (or null for all)")
    if cfg.tokenizer is None and cfg.model_vocab_size is not None and cfg.vocab_size > cfg.model_vocab_size:
        raise ValueError(f"vocab_size={cfg.vocab_size} exceeds model_vocab_size={cfg.model_vocab_size}")
    return corpus


def _source(cfg: PrepareConfig, corpus: str, cache: Path) -> sources.Source:
    hf_cache = cache / "hf_datasets"
    if corpus in corpora.BUILTIN_CORPORA:
        splits = corpora.load_builtin(corpus, cache)
        desc = {"kind": "builtin", "corpus": corpus}
        return sources.Source(splits, val_fraction=cfg.val_fraction, split_seed=cfg.split_seed, description=desc)
    if corpus == "files":
        spec = {"train": ("files", cfg.files)}
        if cfg.val_files:
            spec["validation"] = ("val_files", cfg.val_files)
        if cfg.test_files:
            spec["test"] = ("test_files", cfg.test_files)
        return sources.files_source(
            spec, cfg.format, cfg.text_field, cfg.sample_by, cfg.streaming, hf_cache, cfg.val_fraction, cfg.split_seed,
            cfg.progress,
        )  # type: ignore[arg-type]  # fmt: skip
    return sources.hf_source(
        cfg.hf_name or "", cfg.hf_config, cfg.text_field, cfg.streaming, hf_cache, cfg.val_fraction, cfg.split_seed,
        cfg.progress,
    )  # fmt: skip


def _tokenizer(cfg: PrepareConfig, source: sources.Source, log: Callable[[str], None]) -> tuple[Any, dict, float]:
    """Load `cfg.tokenizer` or train a BPE on the train documents; returns (tok, meta entry, seconds)."""
    t = time.perf_counter()
    if cfg.tokenizer:
        tok = tokmod.load_tokenizer(cfg.tokenizer)
        return tok, {"kind": "file", "path": str(Path(cfg.tokenizer).expanduser().resolve())}, 0.0
    texts = source.train_texts()
    if cfg.tokenizer_train_docs is not None:
        texts = itertools.islice(texts, cfg.tokenizer_train_docs)
    log(f"training byte-level BPE, vocab_size={cfg.vocab_size}")
    tok = tokmod.train_bpe(texts, cfg.vocab_size, cfg.min_frequency)
    desc = {"kind": "bpe", "vocab_size": cfg.vocab_size, "min_frequency": cfg.min_frequency,
            "train_docs": cfg.tokenizer_train_docs}  # fmt: skip
    return tok, desc, time.perf_counter() - t


def _describe(source: sources.Source) -> str:
    files = source.description.get("files")
    return str(files["train"][:5]) if files else str(source.description)


def _remove_stale(out: Path, splits: dict[str, Any]) -> None:
    """Delete shards / indexes of an earlier preparation that the new meta does not list."""
    keep = {s["file"] for sp in splits.values() for s in sp["shards"]} | {sp["doc_index"] for sp in splits.values()}
    for f in out.iterdir():
        if (_SHARD_RE.match(f.name) or f.name.endswith("_docs.npy")) and f.name not in keep:
            f.unlink()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _logger(enabled: bool) -> Callable[[str], None]:
    def log(msg: str) -> None:
        if enabled:
            print(f"[msar-prepare-data] {msg}", file=sys.stderr, flush=True)

    return log


@contextmanager
def _progress(enabled: bool, total: int | None) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar (documents, tokens) on stderr; yields the per-chunk callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = [TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("docs"),
            TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn()]  # fmt: skip
    with Progress(*cols, console=Console(stderr=True)) as bar:
        task = bar.add_task("tokenize", total=total, tokens=0)
        seen = [0]

        def advance(n_docs: int, n_tokens: int) -> None:
            seen[0] += n_tokens
            bar.update(task, advance=n_docs, tokens=seen[0])

        yield advance


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str]) -> PrepareConfig:
    """Parse ``key=value`` arguments into a PrepareConfig (values typed by the field annotations)."""
    hints = typing.get_type_hints(PrepareConfig)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.strip().lstrip("+")  # tolerate Hydra's '+key=value'
        if not sep or key not in hints:
            valid = ", ".join(f.name for f in dataclasses.fields(PrepareConfig))
            raise ValueError(f"bad argument {arg!r}: expected key=value with key one of: {valid}")
        values[key] = _coerce(key, raw, hints[key])
    return PrepareConfig(**values)


def _coerce(key: str, raw: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    optional = (typing.get_origin(hint) in (typing.Union, types.UnionType)) and type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if optional and raw.strip().lower() in ("null", "none", "~", ""):
        return None
    if base is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key}={raw!r} must be true or false")
    if base in (int, float):
        try:
            return base(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} must be a{'n int' if base is int else ' float'}") from None
    return raw


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prepare from ``key=value`` args; returns the process exit code (2 on bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        print("fields:\n" + "\n".join(f"  {f.name} (default {f.default!r})" for f in dataclasses.fields(PrepareConfig)))
        return 0 if argv else 2
    try:
        prepare(parse_args(argv))
    except (ValueError, FileNotFoundError, corpora.CorpusFetchError, sources.SourceUnavailableError) as e:
        print(f"msar-prepare-data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
