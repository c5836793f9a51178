"""Document sources for `prepare`: built-in corpora, local files (via `datasets`), Hugging Face names.

A `Source` is a deterministic stream of ``(split, text)`` pairs, one per document. Splits are
``train``, ``validation`` and ``test``. When the input has no validation split, validation is carved
off the train documents by `val_fraction` (by whole documents, so no document straddles splits):
  * known length n (lists, non-streaming datasets): exactly ``max(1, round(n * f))`` documents
    (and at most n - 1), picked by a permutation seeded with `split_seed`;
  * streaming (length unknown): each document independently with probability f, decided by a hash
    of (split_seed, index), so the same stream always splits the same way.
Empty documents (``""`` or null) are dropped: they would only add a bare EOS.
"""

from __future__ import annotations

import contextlib
import glob
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SPLITS = ("train", "validation", "test")
_SPLIT_ALIASES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
                  "dev": "validation", "test": "test"}  # fmt: skip
_FORMAT_EXTS = {
    "text": (".txt", ".text", ".md"),
    "json": (".json", ".jsonl", ".ndjson"),
    "parquet": (".parquet",),
}
_COMPRESSED = ("", ".gz", ".bz2", ".xz", ".zst")
_ITER_BATCH = 256  # documents fetched per step from a `datasets` object


class SourceUnavailableError(RuntimeError):
    """A remote source (the Hugging Face hub) cannot be reached from this machine."""


@dataclass
class Source:
    """Documents by split. `collections[split]` is a list of str or a (streaming) `datasets` object."""

    collections: dict[str, Any]
    text_field: str = "text"
    val_fraction: float = 0.0  # > 0: carve validation off train (only when no validation split exists)
    split_seed: int = 0
    description: dict[str, Any] = field(default_factory=dict)  # recorded in meta.json["source"]

    def __post_init__(self) -> None:
        self._val_mask: np.ndarray | None = None
        self.carve = self.val_fraction > 0 and "validation" not in self.collections
        n = _known_len(self.collections.get("train"))
        if self.carve and n is not None:
            if n < 2:
                raise ValueError(
                    f"val_fraction={self.val_fraction} needs >= 2 train documents to carve a validation "
                    f"split, the input has {n}; add documents, give a validation split, or set val_fraction=0"
                )
            k = min(n - 1, max(1, round(n * self.val_fraction)))
            mask = np.zeros(n, dtype=bool)
            mask[np.random.default_rng(self.split_seed).permutation(n)[:k]] = True
            self._val_mask = mask

    @property
    def num_documents(self) -> int | None:
        """Total documents over all splits (empty ones included), or None when streaming."""
        lens = [_known_len(c) for c in self.collections.values()]
        return None if any(n is None for n in lens) else sum(lens)  # type: ignore[arg-type]

    def documents(self) -> Iterator[tuple[str, str]]:
        """Yield ``(split, text)`` for every non-empty document, in a fixed order."""
        for name in SPLITS:
            coll = self.collections.get(name)
            if coll is None:
                continue
            try:
                for i, text in enumerate(iter_texts(coll, self.text_field)):
                    split = name
                    if name == "train" and self.carve and self._is_val(i):
                        split = "validation"
                    if text:
                        yield split, text
            except UnicodeDecodeError as e:  # a streaming dataset decodes while it is read: name the file
                files = self.description.get("files", {}).get(name, [])
                bad = next((f for f in files if not _is_utf8(Path(f))), None)
                where = f"input file {bad}" if bad else f"the {name} input {files[:5] or self.description}"
                raise ValueError(f"{where} is not UTF-8 text ({e}); convert it (iconv -t utf-8) or drop it") from None

    def train_texts(self) -> Iterator[str]:
        """Non-empty documents that end up in the train split (for tokenizer training)."""
        return (text for split, text in self.documents() if split == "train")

    def _is_val(self, i: int) -> bool:
        if self._val_mask is not None:
            return bool(self._val_mask[i])
        return _unit_hash(self.split_seed, i) < self.val_fraction


def _is_utf8(path: Path, chunk: int = 1 << 24) -> bool:
    """Whether a file decodes as UTF-8 (incrementally: a code point may straddle two chunks)."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                dec.decode(block)
            dec.decode(b"", final=True)
    except (UnicodeDecodeError, OSError):
        return False
    return True


def iter_texts(coll: Any, text_field: str) -> Iterator[str]:
    """Yield the text of every row of a list of str or a `datasets` (Iterable)Dataset."""
    if isinstance(coll, list):
        yield from coll
        return
    columns = getattr(coll, "column_names", None)
    if columns is not None and text_field not in columns:
        raise ValueError(f"text_field={text_field!r} is not a column of the input; columns are {columns}")
    for batch in coll.iter(batch_size=_ITER_BATCH):
        if text_field not in batch:
            raise ValueError(f"text_field={text_field!r} is not a column of the input; columns are {list(batch)}")
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise ValueError(f"text_field={text_field!r} must hold strings, found {type(text).__name__}")
            yield text or ""


def _known_len(coll: Any) -> int | None:
    if coll is None:
        return 0
    try:
        return len(coll)
    except TypeError:  # IterableDataset (streaming) has no length
        return None


def _unit_hash(seed: int, i: int) -> float:
    """splitmix64 of (seed, i) mapped to [0, 1): a stable per-document coin for streaming splits."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + i + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


@contextlib.contextmanager
def _datasets_bars(enabled: bool) -> Iterator[None]:
    """Switch `datasets`' own progress bars (a global setting) off for a block when `enabled` is False."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    if not enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was and not enabled:
            datasets.enable_progress_bars()


# ----------------------------------------------------------------------------- local files


def infer_format(path: Path) -> str | None:
    """`text` / `json` / `parquet` from a file name (compressed suffixes allowed), else None."""
    name = path.name.lower()
    for fmt, exts in _FORMAT_EXTS.items():
        if any(name.endswith(ext + comp) for ext in exts for comp in _COMPRESSED):
            return fmt
    return None


def resolve_files(spec: str, field_name: str, fmt: str | None) -> list[Path]:
    """Expand a comma-separated list of files, folders (recursive) and globs into sorted files.

    Folders keep only files whose extension matches `fmt` (or any known format when `fmt` is
    None); hidden files are skipped. Raises FileNotFoundError naming `field_name` for a part that
    matches nothing.
    """
    out: list[Path] = []
    for part in (s.strip() for s in spec.split(",")):
        if not part:
            continue
        p = Path(part).expanduser()
        if any(c in part for c in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
            if not matches:
                raise FileNotFoundError(f"{field_name}: pattern {part!r} matches no file")
            out += matches
        elif p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
                and (infer_format(f) == fmt if fmt else infer_format(f) is not None)
            )  # fmt: skip
            if not found:
                raise FileNotFoundError(f"{field_name}: folder {p} holds no {fmt or 'text/json/parquet'} files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{field_name}: no such file or folder: {p}")
    if not out:
        raise ValueError(f"{field_name} is empty")
    return out


def files_source(
    files: dict[str, tuple[str, str]], fmt: str | None, text_field: str, sample_by: str, streaming: bool,
    hf_cache_dir: Path, val_fraction: float, split_seed: int, progress: bool = True,
) -> Source:  # fmt: skip
    """Load local files through ``datasets.load_dataset(fmt, data_files=...)``.

    `files` maps a split to (field name, spec): ``files`` / ``val_files`` / ``test_files``.
    Text documents: `sample_by` = ``document`` (one per file, the default), ``paragraph``
    (blank-line separated) or ``line``.
    """
    resolved = {split: resolve_files(spec, field_name, fmt) for split, (field_name, spec) in files.items()}
    all_files = [f for fs in resolved.values() for f in fs]
    if fmt is None:
        fmts = {infer_format(f) for f in all_files}
        if None in fmts or len(fmts) != 1:
            raise ValueError(
                f"cannot infer format from the file names ({sorted(str(f) for f in all_files)[:5]}...); set format=text|json|parquet"
            )
        fmt = fmts.pop()
    if fmt not in _FORMAT_EXTS:
        raise ValueError(f"format={fmt!r} is not one of {list(_FORMAT_EXTS)}")
    if sample_by not in ("document", "paragraph", "line"):
        raise ValueError(f"sample_by={sample_by!r} must be document, paragraph or line")
    empty = [f for f in all_files if f.stat().st_size == 0]
    if len(empty) == len(all_files):
        raise ValueError(f"input is empty: every file is 0 bytes ({[str(f) for f in empty][:5]})")

    import datasets  # heavy import, only when a files source is used

    kwargs: dict[str, Any] = {"sample_by": sample_by} if fmt == "text" else {}
    try:
        with _datasets_bars(progress):
            dd = datasets.load_dataset(
                fmt, data_files={s: [str(f) for f in fs] for s, fs in resolved.items()},
                cache_dir=str(hf_cache_dir), streaming=streaming, **kwargs,
            )  # fmt: skip
    except Exception as e:  # datasets wraps parse errors in several types; name the inputs
        bad = next((f for f in all_files if fmt != "parquet" and not _is_utf8(f)), None)
        if bad is not None:
            raise ValueError(f"input file {bad} is not UTF-8 text; convert it (iconv -t utf-8) or drop it") from e
        raise ValueError(f"could not read {fmt} files {[str(f) for f in all_files][:5]}: {e}") from e
    desc = {"kind": "files", "format": fmt, "streaming": streaming, "files": {s: [str(f) for f in fs] for s, fs in resolved.items()}}
    if fmt == "text":
        desc["sample_by"] = sample_by
    return Source(dict(dd), text_field, val_fraction, split_seed, desc)


# ----------------------------------------------------------------------------- Hugging Face hub


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def check_hub_reachable(timeout: float = 5.0) -> None:
    """Raise SourceUnavailableError at once when offline mode is set or the hub does not answer.

    Why: `datasets` retries an unreachable hub with back-off for ~20 s before failing, and says
    little about what to do instead.
    """
    hint = "use corpus=files files=... on local files, or a built-in corpus (corpus=shakespeare|ptb)"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _env_true(var):
            raise SourceUnavailableError(f"corpus=hf needs the Hugging Face hub, but {var} is set (offline); {hint}")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered (any status): reachable
    except (urllib.error.URLError, OSError) as e:
        raise SourceUnavailableError(f"corpus=hf: the Hugging Face hub {endpoint} is unreachable ({e}); {hint}") from e


def hf_source(
    name: str, config: str | None, text_field: str, streaming: bool, hf_cache_dir: Path,
    val_fraction: float, split_seed: int, progress: bool = True,
) -> Source:  # fmt: skip
    """A dataset from the hub by name; split names valid/val/dev map to validation."""
    if not name:
        raise ValueError("corpus=hf needs hf_name=<dataset name>")
    check_hub_reachable()
    import datasets

    with _datasets_bars(progress):
        dd = datasets.load_dataset(name, config, streaming=streaming, cache_dir=str(hf_cache_dir))
    colls = {_SPLIT_ALIASES[k]: v for k, v in dd.items() if k in _SPLIT_ALIASES}
    if "train" not in colls:
        raise ValueError(f"hf_name={name!r} has no train split (splits: {list(dd)})")
    desc = {"kind": "hf", "hf_name": name, "hf_config": config, "streaming": streaming}
    return Source(colls, text_field, val_fraction, split_seed, desc)
