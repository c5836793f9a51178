"""`PackedDataset`: one split of a prepared directory (see `prepare.py`) as a verified token stream.

Opening checks, in order, each failing with an error that names the offending file:
  1. meta.json exists, is valid, and lists the split;
  2. tokenizer.json exists and its sha256 equals meta's `tokenizer_sha256` (shards and tokenizer
     belong together) and, when given, the caller's `expected_tokenizer_sha256` (the model was
     trained with that tokenizer);
  3. every shard exists with exactly ``num_tokens * itemsize`` bytes (catches truncation cheaply);
  4. with `verify_checksums` (default) every shard's and the document index's sha256 match meta
     (catches corruption; reads every byte once, ~1 GB/s, so skippable for huge data).
The shards are then memory-mapped read-only; nothing is loaded eagerly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from msar_train.data.io import read_json, sha256_file
from msar_train.errors import InputError

SUPPORTED_FORMAT_VERSIONS = (1,)
_REQUIRED_META = ("format_version", "vocab_size", "dtype", "eos_id", "tokenizer_sha256", "splits")


def _key(obj: Any, key: str | int, field: str, meta_path: Path) -> Any:
    """``obj[key]`` of meta.json, or an error naming the file and the field (``splits.train.shards[0].file``)."""
    try:
        return obj[key]
    except (KeyError, IndexError, TypeError):
        raise InputError(f"{meta_path}: {field} is missing or not where it should be (a damaged or hand-edited meta.json?)") from None


def _count(value: Any, field: str, meta_path: Path) -> int:
    """A non-negative integer field of meta.json (``bool`` and ``"12"`` are refused, like JSON types should be)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{meta_path}: {field}={value!r} must be a non-negative integer")
    return value


class PackedDataset:
    """Read-only token stream of one split: documents, each followed by EOS, concatenated.

    Attributes: `path`, `split`, `meta` (the whole meta.json), `vocab_size`, `eos_id`, `dtype`,
    `num_tokens`, `num_documents`, `doc_offsets` (int64, shape (num_documents + 1,)).
    """

    def __init__(
        self,
        path: str | Path,
        split: str = "train",
        *,
        verify_checksums: bool = True,
        expected_tokenizer_sha256: str | None = None,
    ) -> None:
        self.path = Path(path).expanduser()
        self.split = split
        meta_path = self.path / "meta.json"
        if not meta_path.is_file() and self.path.is_dir():
            raise FileNotFoundError(f"{meta_path} not found: {self.path} is not a prepared data dir (or its preparation did not finish)")
        self.meta: dict[str, Any] = read_json(meta_path, "prepared-data meta")
        missing = [k for k in _REQUIRED_META if k not in self.meta]
        if missing:
            raise ValueError(f"{meta_path} lacks the keys {missing}")
        if self.meta["format_version"] not in SUPPORTED_FORMAT_VERSIONS:
            raise ValueError(f"{meta_path}: format_version {self.meta['format_version']} is not supported")
        if not isinstance(self.meta["splits"], dict):
            raise InputError(f"{meta_path}: splits must be an object of split name -> shards, got {type(self.meta['splits']).__name__}")
        if split not in self.meta["splits"]:
            raise ValueError(f"split {split!r} is not in {meta_path} (it has {sorted(self.meta['splits'])})")
        self._meta_path = meta_path
        self.vocab_size: int = _count(self.meta["vocab_size"], "vocab_size", meta_path)
        self.eos_id: int = _count(self.meta["eos_id"], "eos_id", meta_path)
        if self.meta["dtype"] not in ("uint16", "uint32"):
            raise InputError(f"{meta_path}: dtype={self.meta['dtype']!r} must be uint16 or uint32")
        self.dtype = np.dtype(self.meta["dtype"])
        self._check_tokenizer(expected_tokenizer_sha256)

        entry = self.meta["splits"][split]
        where = f"splits.{split}"
        self.num_tokens: int = _count(_key(entry, "num_tokens", f"{where}.num_tokens", meta_path), f"{where}.num_tokens", meta_path)
        self._shards: list[np.memmap] = []
        self._files: list[Path] = []
        starts = [0]
        shards = _key(entry, "shards", f"{where}.shards", meta_path)
        if not isinstance(shards, list):
            raise InputError(f"{meta_path}: {where}.shards must be a list, got {type(shards).__name__}")
        for i, shard in enumerate(shards):
            self._shards.append(self._open_shard(shard, verify_checksums, f"{where}.shards[{i}]"))
            self._files.append(self.path / shard["file"])
            starts.append(starts[-1] + int(shard["num_tokens"]))
        self._starts = np.asarray(starts, dtype=np.int64)  # stream offset of each shard, plus the end
        if starts[-1] != self.num_tokens:
            raise ValueError(f"{meta_path}: split {split} shards add up to {starts[-1]} tokens, not {self.num_tokens}")
        self.doc_offsets = self._open_index(entry, verify_checksums)
        self.num_documents: int = int(self.doc_offsets.size - 1)

    # ------------------------------------------------------------------ opening checks

    def _check_tokenizer(self, expected: str | None) -> None:
        tok_path = self.path / self.meta.get("tokenizer_file", "tokenizer.json")
        if not tok_path.is_file():
            raise FileNotFoundError(f"tokenizer file {tok_path} is missing (listed in {self.path / 'meta.json'})")
        recorded = self.meta["tokenizer_sha256"]
        actual = sha256_file(tok_path)
        if actual != recorded:
            raise ValueError(
                f"{tok_path} (sha256 {actual[:12]}…) is not the tokenizer the shards in {self.path} were made "
                f"with (meta.json tokenizer_sha256 {recorded[:12]}…); re-run the preparation"
            )
        if expected is not None and expected != recorded:
            raise ValueError(
                f"{self.path} was tokenized with tokenizer sha256 {recorded[:12]}…, but "
                f"expected_tokenizer_sha256 is {expected[:12]}…: the model was trained with another tokenizer"
            )

    def _open_shard(self, shard: dict[str, Any], verify: bool, field: str) -> np.memmap:
        m = self._meta_path
        name = _key(shard, "file", f"{field}.file", m)
        if not isinstance(name, str) or not name:
            raise InputError(f"{m}: {field}.file={name!r} must be a file name")
        f = self.path / name
        n = _count(_key(shard, "num_tokens", f"{field}.num_tokens", m), f"{field}.num_tokens", m)
        if not f.is_file():
            raise FileNotFoundError(f"token shard {f} is missing (listed in {self.path / 'meta.json'})")
        want = n * self.dtype.itemsize
        have = f.stat().st_size
        if have != want:
            kind = "truncated" if have < want else "longer than expected"
            raise ValueError(f"token shard {f} is {kind}: {have} bytes, meta.json says {n} tokens x {self.dtype.itemsize} = {want}")
        if verify and (digest := sha256_file(f)) != _key(shard, "sha256", f"{field}.sha256", m):
            raise ValueError(
                f"token shard {f} is corrupted: sha256 {digest[:12]}… != {shard['sha256'][:12]}… in meta.json "
                "(pass verify_checksums=False to skip this check)"
            )
        return np.memmap(f, dtype=self.dtype, mode="r", shape=(n,))

    def _open_index(self, entry: dict[str, Any], verify: bool) -> np.ndarray:
        where = f"splits.{self.split}"
        f = self.path / str(_key(entry, "doc_index", f"{where}.doc_index", self._meta_path))
        n_docs = _count(_key(entry, "num_documents", f"{where}.num_documents", self._meta_path), f"{where}.num_documents", self._meta_path)
        if not f.is_file():
            raise FileNotFoundError(f"document index {f} is missing (listed in {self.path / 'meta.json'})")
        if verify and "doc_index_sha256" in entry and (digest := sha256_file(f)) != entry["doc_index_sha256"]:
            raise ValueError(f"document index {f} is corrupted: sha256 {digest[:12]}… does not match meta.json")
        try:
            offsets = np.load(f, mmap_mode="r")
        except ValueError as e:
            raise ValueError(f"document index {f} is unreadable: {e}") from e
        ok = (
            offsets.ndim == 1
            and offsets.dtype == np.int64
            and offsets.size == n_docs + 1
            and offsets[0] == 0
            and offsets[-1] == self.num_tokens
        )
        if not ok:
            raise ValueError(f"document index {f} does not match meta.json ({n_docs} documents, {self.num_tokens} tokens)")
        return offsets

    # ------------------------------------------------------------------ access

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Copy of stream tokens ``[start, stop)`` (may span shards), in the storage dtype."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens}) of split {self.split}")
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        while start < stop:
            lo = start - int(self._starts[k])
            take = min(stop - start, int(self._starts[k + 1]) - start)
            parts.append(self._shards[k][lo : lo + take])
            start += take
            k += 1
        if len(parts) == 1:
            return np.array(parts[0])
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def locate(self, pos: int) -> tuple[Path, int]:
        """Stream position ``pos`` -> (the shard file holding it, the token offset within that shard)."""
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        return self._files[k], pos - int(self._starts[k])

    def document(self, d: int) -> np.ndarray:
        """Tokens of document `d` without its trailing EOS."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} outside [0, {self.num_documents}) of split {self.split}")
        return self.tokens(int(self.doc_offsets[d]), int(self.doc_offsets[d + 1]) - 1)

    def load_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` the shards were made with (for decoding / generation)."""
        from msar_train.data.tokenizer import load_tokenizer

        return load_tokenizer(self.path / self.meta.get("tokenizer_file", "tokenizer.json"))

    def __repr__(self) -> str:
        return (
            f"PackedDataset({str(self.path)!r}, split={self.split!r}, tokens={self.num_tokens}, "
            f"documents={self.num_documents}, vocab={self.vocab_size})"
        )
