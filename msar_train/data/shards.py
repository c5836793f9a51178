"""Tokenize a document stream (in parallel) and write per-split token shards + document indexes.

On-disk layout of one split (all written atomically, see `io.atomic_open`):
  ``<split>_000000.bin``, ``<split>_000001.bin``, ...  raw little-endian token ids (`dtype`), read
      with ``np.memmap(file, dtype, mode="r")``. Concatenated in order they form the split's token
      stream: every document's tokens followed by one EOS. A document may cross a shard boundary;
      every shard but the last holds exactly `shard_tokens` tokens.
  ``<split>_docs.npy``  int64 offsets, shape (num_documents + 1,): document d is
      ``stream[offsets[d]:offsets[d+1]]`` and ends with its EOS; offsets[0] = 0, offsets[-1] = num_tokens.

`encode_documents` is the hot path (timing it = timing tokenization); it returns per-split metadata.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from msar_train.data.io import atomic_open, make_temp, sha256_file

_CHUNK_DOCS = 512  # documents per task sent to a worker ...
_CHUNK_CHARS = 1 << 20  # ... or fewer, once they add up to ~1 MiB of text (bounds worker memory)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token ids of one split to fixed-size shard files; see the module doc for the layout."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens <= 0:
            raise ValueError(f"shard_tokens={shard_tokens} must be > 0")
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.doc_lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self._file: Any = None  # open temp file of the current shard
        self._tmp: str | None = None
        self._hash: Any = None
        self._in_shard = 0

    def append(self, ids: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append `ids` (1-D, already EOS-terminated documents) whose documents have `doc_lengths`."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        self.doc_lengths.append(np.asarray(doc_lengths, dtype=np.int64))
        self.num_tokens += int(ids.size)
        pos = 0
        while pos < ids.size:
            if self._file is None:
                fd, self._tmp = make_temp(self.out_dir / self.split)
                self._file, self._hash, self._in_shard = os.fdopen(fd, "wb"), hashlib.sha256(), 0
            take = min(ids.size - pos, self.shard_tokens - self._in_shard)
            buf = ids[pos : pos + take].tobytes()
            self._file.write(buf)
            self._hash.update(buf)
            self._in_shard += take
            pos += take
            if self._in_shard == self.shard_tokens:
                self._publish_shard()

    def _publish_shard(self) -> None:
        assert self._file is not None and self._tmp is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        os.replace(self._tmp, self.out_dir / name)
        self.shards.append({"file": name, "num_tokens": self._in_shard, "sha256": self._hash.hexdigest()})
        self._file = self._tmp = None

    def finish(self) -> dict[str, Any]:
        """Publish the last shard and the document index; return this split's meta entry."""
        if self._file is not None and self._in_shard > 0:
            self._publish_shard()
        lengths = np.concatenate(self.doc_lengths) if self.doc_lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        assert offsets[-1] == self.num_tokens, "document lengths must add up to the token count"
        index_name = f"{self.split}_docs.npy"
        with atomic_open(self.out_dir / index_name) as f:
            np.save(f, offsets)
        return {
            "doc_index_sha256": sha256_file(self.out_dir / index_name),
            "num_tokens": self.num_tokens,
            "num_documents": int(lengths.size),
            "shards": self.shards,
            "doc_index": index_name,
        }

    def abort(self) -> None:
        """Drop the unfinished shard's temp file (already published shards stay; meta.json won't list them)."""
        if self._file is not None:
            self._file.close()
            if self._tmp:
                Path(self._tmp).unlink(missing_ok=True)
            self._file = self._tmp = None


# ----------------------------------------------------------------------------- parallel encoding

_WORKER_TOK: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no nested threads
    _WORKER_TOK = Tokenizer.from_str(tokenizer_json)
    _WORKER_TOK.encode_special_tokens = True  # not serialised by to_str(); see tokenizer.py


def _encode_chunk(task: tuple[list[str], int, str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode documents -> (ids with EOS after each document, per-document lengths incl. EOS)."""
    texts, eos_id, dtype = task
    tok = _WORKER_TOK
    assert tok is not None, "worker not initialised"
    encs = tok.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encs), dtype=np.int64, count=len(encs))
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for e, n in zip(encs, lengths):
        ids[pos : pos + n - 1] = e.ids
        ids[pos + n - 1] = eos_id
        pos += n
    return ids, lengths


def _chunks(docs: Iterable[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    """Group the stream into chunks of whole documents; yields (split labels, texts)."""
    splits: list[str] = []
    texts: list[str] = []
    chars = 0
    for split, text in docs:
        splits.append(split)
        texts.append(text)
        chars += len(text)
        if len(texts) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
            yield splits, texts
            splits, texts, chars = [], [], 0
    if texts:
        yield splits, texts


def encode_documents(
    tok: Tokenizer,
    docs: Iterable[tuple[str, str]],
    writers: dict[str, ShardWriter],
    eos_id: int,
    num_proc: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Tokenize ``(split, text)`` pairs and append them, in order, to ``writers[split]``.

    num_proc > 1 uses a process pool (fork where available) with at most 2 * num_proc chunks in
    flight (bounded memory on any input size); results are consumed in input order, so the output
    is byte-identical for any num_proc. `progress(n_docs, n_tokens)` is called once per chunk.
    """
    if num_proc < 1:
        raise ValueError(f"num_proc={num_proc} must be >= 1")
    dtype = next(iter(writers.values())).dtype.str
    if num_proc == 1:
        _init_worker(tok.to_str())
        for splits, texts in _chunks(docs):
            _route(splits, _encode_chunk((texts, eos_id, dtype)), writers, progress)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(num_proc, initializer=_init_worker, initargs=(tok.to_str(),)) as pool:
        pending: deque[tuple[list[str], Any]] = deque()
        for splits, texts in _chunks(docs):
            pending.append((splits, pool.apply_async(_encode_chunk, ((texts, eos_id, dtype),))))
            if len(pending) >= 2 * num_proc:
                labels, res = pending.popleft()
                _route(labels, res.get(), writers, progress)
        while pending:
            labels, res = pending.popleft()
            _route(labels, res.get(), writers, progress)


def _route(
    splits: list[str],
    result: tuple[np.ndarray, np.ndarray],
    writers: dict[str, ShardWriter],
    progress: Callable[[int, int], None] | None,
) -> None:
    """Append one encoded chunk to the writers of its documents' splits."""
    ids, lengths = result
    labels = np.asarray(splits)
    if (labels == labels[0]).all():
        writers[splits[0]].append(ids, lengths)
    else:  # mixed chunk (validation carved out of train): split it by document label
        tok_labels = np.repeat(labels, lengths)
        for split in dict.fromkeys(splits):  # first-seen order
            writers[split].append(ids[tok_labels == split], lengths[labels == split])
    if progress is not None:
        progress(int(lengths.size), int(ids.size))
