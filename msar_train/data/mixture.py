"""`MixtureLoader`: batches drawn from several prepared dirs in fixed proportions (``data.mixture``).

Legend: B = micro batch size (per rank), W = data-parallel world, R = B * W rows of one global
micro batch (every rank's micro batch of the same micro step, rank r holding rows [r*B, (r+1)*B)),
T = seq_len, S = number of sources, p_s = weight_s / sum of the weights.

Which source fills a row. The schedule is global, the same on every rank, and a function of the
source counts only: ``counts[s]`` = rows of source s drawn so far (over all ranks and micro steps).
The next row goes to the source with the largest deficit ``p_s * (N + 1) - counts[s]`` (N =
sum(counts); ties to the lower index), so after any number of rows every count is within one row of
``p_s * N``: the proportions hold per micro batch, not only on average. Within micro step k the R
rows so chosen are then shuffled by a permutation drawn from ``SeedSequence((seed, 0x6D6978, k))``
(shuffle=True) so no rank or row position is tied to a source.

Which sample fills a row. Source s serves its samples (packed windows as in ``loader.py``) in the
order of one world-1 permutation per epoch, ``SeedSequence((seed, s, e))`` (the identity with
shuffle=False): the d-th row ever drawn from s (d counted globally, in row order of the micro step)
is sample ``perm_e[d mod n_s]`` of epoch ``e = d // n_s``. So a source repeats nothing until all of
its samples were seen, ranks never share a sample within an epoch of a source, and the W ranks'
micro batches concatenated are exactly the world-1 loader's micro batch of B * W rows.

Resume: the state is the micro step and the counts (plain ints, identical on every rank, so rank
0's state serves all); `load_state_dict` refuses a state of other sources, weights, seed, T or
shuffle, and of another R unless ``relayout`` (then the step is moved to ``step * R / R'`` when that
divides, the counts being a function of the rows drawn only, else refused naming the fields).
The counts are also the ``data/tokens/<name>`` metrics (counts * T, all ranks together).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from msar_train.config.validate import mixture_entries
from msar_train.data.loader import Batch, PackedLoader
from msar_train.data.packed import PackedDataset
from msar_train.errors import InputError

_ARRANGE_TAG = 0x6D6978  # "mix": keeps the row shuffle's seeds apart from the sources' epoch seeds


def deficit_schedule(probs: np.ndarray, counts: np.ndarray, rows: int) -> np.ndarray:
    """Sources of the next `rows` rows (largest-deficit rule, see the module doc); advances `counts` in place."""
    out = np.empty(rows, dtype=np.int64)
    n = int(counts.sum())
    for j in range(rows):
        s = int(np.argmax(probs * (n + 1) - counts))
        out[j] = s
        counts[s] += 1
        n += 1
    return out


class MixtureLoader:
    """Infinite iterator of `Batch`es mixing the `datasets` (one split each) with `weights`.

    Same interface as `PackedLoader` where the trainer uses it (``next``, `batch_at`, `batches`,
    `state_dict` / `load_state_dict`, `metrics`). A mixture has no epochs of its own: ``len`` is the
    micro steps until the first positive-weight source would start its second epoch (what
    ``batches(None)`` serves) and ``batch_at(epoch, index)`` is micro step ``epoch * len + index``.
    """

    def __init__(
        self,
        datasets: Sequence[PackedDataset],
        names: Sequence[str],
        weights: Sequence[float],
        seq_len: int,
        micro_batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        document_mask: bool = False,
    ) -> None:
        if not datasets or not len(datasets) == len(names) == len(weights):
            raise ValueError(f"a mixture needs as many names and weights as datasets ({len(datasets)}, {len(names)}, {len(weights)})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank={rank} must be in [0, world={world})")
        w = np.asarray(weights, dtype=np.float64)
        if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
            raise ValueError(f"mixture weights {list(weights)} must be finite, >= 0 and sum to a positive number")
        self.names, self.weights = list(names), [float(x) for x in weights]
        self.probs = w / w.sum()
        self.seq_len, self.micro_batch_size, self.seed, self.rank, self.world = seq_len, micro_batch_size, seed, rank, world
        self.shuffle, self.document_mask = shuffle, document_mask
        self.rows = micro_batch_size * world
        # One world-1 loader per source: the packed windows, the vocab check and the document mask of
        # `make_batch`; their own order (shuffle=False) is not used.
        self.sources = [
            PackedLoader(ds, seq_len, 1, seed=seed, shuffle=False, document_mask=document_mask) for ds in datasets
        ]  # fmt: skip
        self.num_samples = [src.num_samples for src in self.sources]
        horizon = [n / (p * self.rows) for n, p in zip(self.num_samples, self.probs, strict=True) if p > 0]
        self.steps_per_epoch = max(1, int(min(horizon)))
        self.step = 0  # micro steps taken
        self.counts = np.zeros(len(self.sources), dtype=np.int64)  # rows drawn per source, all ranks
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its permutation)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> MixtureLoader:
        return self

    # ------------------------------------------------------------------ the order

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(s)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = self.num_samples[s]
        if self.shuffle:
            perm = np.random.default_rng(np.random.SeedSequence((self.seed, s, epoch))).permutation(n)
        else:
            perm = np.arange(n, dtype=np.int64)
        self._perms[s] = (epoch, perm)
        return perm

    def global_rows(self, step: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample id) of each of the R rows of micro step `step`, given the counts before it.

        Advances `counts` in place to the counts after the step.
        """
        start = counts.copy()
        sources = deficit_schedule(self.probs, counts, self.rows)
        draws = np.empty(self.rows, dtype=np.int64)  # d: the d-th row ever drawn from its source
        for s in range(len(self.sources)):
            mask = sources == s
            draws[mask] = start[s] + np.arange(int(mask.sum()))
        if self.shuffle:
            order = np.random.default_rng(np.random.SeedSequence((self.seed, _ARRANGE_TAG, step))).permutation(self.rows)
            sources, draws = sources[order], draws[order]
        samples = np.empty(self.rows, dtype=np.int64)
        for j, (s, d) in enumerate(zip(sources.tolist(), draws.tolist(), strict=True)):
            n = self.num_samples[s]
            samples[j] = self._perm(s, d // n)[d % n]
        return sources, samples

    def _make(self, sources: np.ndarray, samples: np.ndarray) -> Batch:
        """This rank's rows of a global micro batch, gathered from their sources into one Batch."""
        B, lo = self.micro_batch_size, self.rank * self.micro_batch_size
        src, ids = sources[lo : lo + B], samples[lo : lo + B]
        parts: list[tuple[np.ndarray, Batch]] = []
        for s in np.unique(src).tolist():
            rows = np.flatnonzero(src == s)
            parts.append((rows, self.sources[s].make_batch(ids[rows])))
        x = torch.empty((B, self.seq_len), dtype=torch.int64)
        y = torch.empty_like(x)
        doc = torch.empty_like(x) if self.document_mask else None
        pos = torch.empty_like(x) if self.document_mask else None
        for rows, b in parts:
            idx = torch.from_numpy(rows)
            x[idx], y[idx] = b.input_ids_BT, b.labels_BT
            if doc is not None and pos is not None:
                doc[idx], pos[idx] = b.doc_ids_BT, b.positions_BT  # type: ignore[assignment]
        return Batch(x, y, doc, pos)

    def batch_at(self, epoch: int, index: int) -> Batch:
        """This rank's micro batch of micro step ``epoch * len + index`` (pure: does not move the loader)."""
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise IndexError(f"batch index {index} outside [0, {self.steps_per_epoch}) or epoch {epoch} < 0")
        step = epoch * self.steps_per_epoch + index
        counts = np.zeros_like(self.counts)
        for _ in range(step):  # the schedule depends on the counts only: replay it (cheap, integer work)
            deficit_schedule(self.probs, counts, self.rows)
        return self._make(*self.global_rows(step, counts))

    def __next__(self) -> Batch:
        batch = self._make(*self.global_rows(self.step, self.counts))
        self.step += 1
        return batch

    def batches(self, n: int | None = None, epoch: int = 0) -> Iterator[Batch]:
        """The first `n` micro batches (at most ``len``) from micro step ``epoch * len``; no state change.

        With ``shuffle=False`` this is the same fixed batches on every call (evaluation).
        """
        count = self.steps_per_epoch if n is None else min(n, self.steps_per_epoch)
        counts = np.zeros_like(self.counts)
        for _ in range(epoch * self.steps_per_epoch):
            deficit_schedule(self.probs, counts, self.rows)
        for i in range(count):
            yield self._make(*self.global_rows(epoch * self.steps_per_epoch + i, counts))

    def metrics(self) -> dict[str, float]:
        """``data/tokens/<name>``: input tokens drawn from each source so far, all ranks together."""
        return {f"data/tokens/{name}": float(c * self.seq_len) for name, c in zip(self.names, self.counts.tolist(), strict=True)}

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict position (JSON-serialisable), the same on every rank."""
        return {
            "kind": "mixture",
            "step": self.step,
            "counts": self.counts.tolist(),
            "names": list(self.names),
            "weights": list(self.weights),
            "num_samples": list(self.num_samples),
            "seed": self.seed,
            "rows": self.rows,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world": self.world,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any], relayout: bool = False) -> None:
        """Continue exactly where `state` left off.

        The order-defining fields (sources and their sizes, weights, seed, R = global rows per micro
        step, seq_len, shuffle) must match; rank, world and B may differ as long as R does (the order
        is global). A single-source loader's state is refused.

        ``relayout=True`` (a resume under another parallel layout) also accepts another R: the
        ``step * R`` global rows drawn so far are the first rows of the layout-free source sequence
        of the largest-deficit rule, and the counts (which samples of each source were drawn) depend
        on that row count only, so this loader continues at micro step ``step * R / R'`` with the
        same counts when its own ``R' = B' * W'`` divides the rows drawn (else a ``ValueError`` naming
        ``parallel.micro_batch_size`` and the data-parallel ranks). The next rows are then those of
        an uninterrupted run under the new layout: no sample repeats or is skipped.
        """
        if state.get("kind") != "mixture":
            raise ValueError(
                "the loader state is of a single-source run (data.path / data.corpus), not of data.mixture: "
                "resuming would not continue the same sample order"
            )
        keys = ["names", "weights", "num_samples", "seed", "rows", "seq_len", "shuffle"]
        if relayout:
            keys.remove("rows")
        for key in keys:
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"mixture loader state has {key}={state.get(key)!r} but this loader has {key}={getattr(self, key)!r}: "
                    "resuming would not continue the same sample order"
                )
        counts = [int(c) for c in state["counts"]]
        step, rows = int(state["step"]), int(state["rows"])
        if step < 0 or rows < 1 or len(counts) != len(self.sources) or min(counts) < 0 or sum(counts) != step * rows:
            raise ValueError(f"mixture loader state step={step} counts={counts} is inconsistent ({rows} rows per step)")
        if rows != self.rows:
            drawn = step * rows
            if drawn % self.rows:
                world = int(state.get("world", 1))
                micro = int(state.get("micro_batch_size", rows // max(world, 1)))
                raise ValueError(
                    f"the checkpoint's mixture position ({drawn} rows, taken as {world} data-parallel ranks x micro-batches "
                    f"of {micro}) is not a multiple of this layout's parallel.micro_batch_size={self.micro_batch_size} x "
                    f"{self.world} data-parallel ranks = {self.rows}: the mixture's sample order could not continue exactly"
                )
            step = drawn // self.rows
        self.step, self.counts = step, np.asarray(counts, dtype=np.int64)


def open_mixture(
    mixture: Any, data_path: Any, split: str, *, verify_checksums: bool = True, expected_tokenizer_sha256: str | None = None
) -> tuple[list[str], list[float], list[PackedDataset]] | None:
    """The sources of ``data.mixture`` opened at `split`: (names, weights, datasets).

    Checks, each failing with an `InputError` naming the field: the entries (`mixture_entries`),
    every ``data.mixture[i].path`` is a prepared dir with a meta.json, and all sources were made with
    one tokenizer (meta.json ``tokenizer_sha256``; the message names both sources). Returns None
    when some source has no `split` (then the bundle has no such split, as for a single source).
    """
    entries = mixture_entries(mixture, data_path)
    names, weights, datasets = [], [], []
    first: tuple[int, Path, str] | None = None
    for i, (name, raw, weight) in enumerate(entries):
        root = Path(raw).expanduser()
        field = f"data.mixture[{i}].path={raw}"
        if not root.is_dir():
            raise InputError(f"{field}: not a directory (make it with msar-prepare-data)")
        if not (root / "meta.json").is_file():
            raise InputError(f"{field}: {root / 'meta.json'} not found: not a prepared data dir (or its preparation did not finish)")
        try:
            verify = verify_checksums and split == "train"
            ds = PackedDataset(root, "train", verify_checksums=verify, expected_tokenizer_sha256=expected_tokenizer_sha256)
        except (ValueError, OSError) as err:
            raise InputError(f"{field}: {err}") from err
        sha = ds.meta["tokenizer_sha256"]
        if first is None:
            first = (i, root, sha)
        elif sha != first[2]:
            j, root0, sha0 = first
            raise InputError(
                f"{field}: tokenized with tokenizer sha256 {sha[:12]}…, but data.mixture[{j}].path={root0} with {sha0[:12]}…: "
                "a mixture needs one tokenizer (prepare every source with msar-prepare-data tokenizer=<the same tokenizer.json>)"
            )
        if split not in ds.meta["splits"]:
            return None
        if split != "train":
            try:
                ds = PackedDataset(root, split, verify_checksums=verify_checksums, expected_tokenizer_sha256=expected_tokenizer_sha256)
            except (ValueError, OSError) as err:
                raise InputError(f"{field}: {err}") from err
        names.append(name)
        weights.append(weight)
        datasets.append(ds)
    return names, weights, datasets
