"""Packed, deterministic, data-parallel-aware batches from a `PackedDataset`.

Legend: B = micro batch size (per rank), T = seq_len.

Samples: the split's token stream (documents separated by EOS) is cut into overlapping windows of
T + 1 tokens, sample i = stream[i*T : i*T + T + 1]; input = window[:-1], labels = window[1:].
So there are ``(num_tokens - 1) // T`` samples and every token is predicted exactly once.

Order: epoch e uses the permutation of all sample ids drawn from ``SeedSequence((seed, e))``
(a pair rather than ``seed + e`` so seed s epoch 1 never equals seed s+1 epoch 0). Rank r of w
takes ``perm[r : n_w : w]`` with ``n_w = (num_samples // w) * w``: ranks never share a sample
in an epoch, together cover all but < w samples, and all get the same count. Each rank groups
its samples into batches of B in order and drops the last partial batch, so every rank runs
the same number of steps per epoch. With ``shuffle=False`` the permutation is the identity
(fixed order, for evaluation).

Document mask (``document_mask=True``): per sample, ``doc_ids_BT[b, t]`` = number of EOS tokens in
``input_ids_BT[b, :t]`` (the EOS closes its document; the next token starts a new id) and
``positions_BT[b, t]`` = t minus the start of that document within the sample (0 at the sample
start and right after every EOS). Tokens with different doc ids belong to different documents.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from msar_train.data.packed import PackedDataset
from msar_train.errors import InputError

__all__ = ["Batch", "PackedDataset", "PackedLoader", "document_ids_and_positions"]


@dataclass
class Batch:
    """One micro batch. All tensors are int64 of shape (B, T) on the CPU until `.to()`."""

    input_ids_BT: torch.Tensor
    labels_BT: torch.Tensor
    doc_ids_BT: torch.Tensor | None = None
    positions_BT: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Copy of the batch with every tensor moved to `device`."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(mv(self.input_ids_BT), mv(self.labels_BT), mv(self.doc_ids_BT), mv(self.positions_BT))  # type: ignore[arg-type]


def document_ids_and_positions(input_ids_BT: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample document ids and within-document positions (see the module doc), int64 (B, T)."""
    B, T = input_ids_BT.shape
    is_eos = input_ids_BT == eos_id
    doc_ids = np.zeros((B, T), dtype=np.int64)
    np.cumsum(is_eos[:, :-1], axis=1, out=doc_ids[:, 1:])
    t = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
    starts = np.zeros((B, T), dtype=np.int64)
    starts[:, 1:] = np.where(is_eos[:, :-1], t[:, 1:], 0)  # a document starts right after an EOS
    np.maximum.accumulate(starts, axis=1, out=starts)
    return doc_ids, t - starts


class PackedLoader:
    """Infinite iterator of `Batch`es over one split; resumable via `state_dict` / `load_state_dict`.

    `next(loader)` returns the batch at (epoch, index) and advances; after the last batch of an
    epoch it moves to the next epoch (reshuffled). `len(loader)` = batches per epoch per rank.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        seq_len: int,
        micro_batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        document_mask: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank={rank} must be in [0, world={world})")
        self.dataset, self.seq_len, self.micro_batch_size = dataset, seq_len, micro_batch_size
        self.seed, self.rank, self.world = seed, rank, world
        self.shuffle, self.document_mask = shuffle, document_mask
        self.num_samples = max(0, (dataset.num_tokens - 1) // seq_len)
        self.samples_per_rank = self.num_samples // world
        self.steps_per_epoch = self.samples_per_rank // micro_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"split {dataset.split!r} of {dataset.path} has {dataset.num_tokens} tokens = {self.num_samples} "
                f"samples of seq_len={seq_len}: too few for one batch of micro_batch_size={micro_batch_size} "
                f"on each of world={world} ranks; lower seq_len / micro_batch_size or add data"
            )
        self.epoch = 0
        self.index = 0  # batches already taken in the current epoch
        self._cached: tuple[int, np.ndarray] | None = None  # (epoch, this rank's sample ids)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def rank_samples(self, epoch: int) -> np.ndarray:
        """This rank's sample ids for `epoch`, in the order they are served (length samples_per_rank)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n = self.num_samples
        if self.shuffle:
            order = np.random.default_rng(np.random.SeedSequence((self.seed, epoch))).permutation(n)
        else:
            order = np.arange(n, dtype=np.int64)
        mine = order[self.rank : self.samples_per_rank * self.world : self.world]
        self._cached = (epoch, mine)
        return mine

    def batch_at(self, epoch: int, index: int) -> Batch:
        """The `index`-th batch of `epoch` on this rank (pure: does not move the loader)."""
        if not 0 <= index < self.steps_per_epoch:
            raise IndexError(f"batch index {index} outside [0, {self.steps_per_epoch})")
        B = self.micro_batch_size
        return self.make_batch(self.rank_samples(epoch)[index * B : (index + 1) * B])

    def make_batch(self, sample_ids: np.ndarray) -> Batch:
        """Gather samples `sample_ids` into a Batch (B = len(sample_ids))."""
        T = self.seq_len
        windows = np.stack([self.dataset.tokens(int(i) * T, int(i) * T + T + 1) for i in sample_ids])
        if int(windows.max()) >= self.dataset.vocab_size:  # one max per batch: damaged shards fail here, not in the embedding
            self._refuse_token(sample_ids, windows)
        windows = windows.astype(np.int64)
        x, y = windows[:, :-1], windows[:, 1:]
        batch = Batch(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)))
        if self.document_mask:
            doc_ids, pos = document_ids_and_positions(x, self.dataset.eos_id)
            batch.doc_ids_BT, batch.positions_BT = torch.from_numpy(doc_ids), torch.from_numpy(pos)
        return batch

    def _refuse_token(self, sample_ids: np.ndarray, windows: np.ndarray) -> None:
        b, t = (int(v) for v in np.argwhere(windows >= self.dataset.vocab_size)[0])
        shard, offset = self.dataset.locate(int(sample_ids[b]) * self.seq_len + t)
        raise InputError(
            f"token shard {shard}: token id {int(windows[b, t])} at token offset {offset} is outside the vocabulary "
            f"of size {self.dataset.vocab_size} (meta.json vocab_size): the shard is damaged or was made with another "
            "tokenizer; re-run the preparation, or keep data.verify_checksums=true to catch damage when the data is opened"
        )

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.epoch, self.index)
        self.index += 1
        if self.index == self.steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def batches(self, n: int | None = None, epoch: int = 0) -> Iterator[Batch]:
        """The first `n` batches (all of them when None or n > len) of `epoch`; no state change.

        For evaluation: with ``shuffle=False`` this is the same fixed batches on every call.
        """
        count = self.steps_per_epoch if n is None else min(n, self.steps_per_epoch)
        for i in range(count):
            yield self.batch_at(epoch, i)

    def metrics(self) -> dict[str, float]:
        """Data metrics for the train log: none for one source (a mixture logs ``data/tokens/<name>``)."""
        return {}

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict position (JSON-serialisable); the next batch after load is `batch_at(epoch, index)`."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "rank": self.rank,
            "world": self.world,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "split": self.dataset.split,
        }

    def load_state_dict(self, state: dict[str, Any], relayout: bool = False) -> None:
        """Continue exactly where `state` left off.

        The order-defining fields (seed, world, micro_batch_size, seq_len, shuffle, num_samples =
        the same data) must match this loader; `rank` may differ (ranks advance in lockstep, so
        rank 0's state serves every rank) and is kept.

        ``relayout=True`` (a resume under another parallel layout) also accepts another `world` and
        `micro_batch_size`: the ranks of a step together take the next ``micro_batch_size * world``
        samples of the epoch's permutation (module doc), so the `index * B * w` samples consumed so far
        are a prefix of it, and this loader continues after that prefix when its own ``B' * w'``
        divides it (else a ``ValueError``: the sample order could not continue).
        """
        if state.get("kind") == "mixture":
            raise ValueError(
                "the loader state is of a data.mixture run, not of one source: resuming would not continue the same sample order"
            )
        keys = ("seed", "world", "micro_batch_size", "seq_len", "shuffle", "num_samples")
        if relayout and (state.get("world", self.world), state.get("micro_batch_size", self.micro_batch_size)) != (
            self.world,
            self.micro_batch_size,
        ):
            keys = ("seed", "seq_len", "shuffle", "num_samples")
            consumed = int(state["index"]) * int(state["micro_batch_size"]) * int(state["world"])
            per_step = self.micro_batch_size * self.world
            if consumed % per_step:
                raise ValueError(
                    f"the checkpoint's data position ({consumed} samples of epoch {state['epoch']}, taken as "
                    f"{state['world']} ranks x micro-batches of {state['micro_batch_size']}) is not a multiple of this layout's "
                    f"parallel.micro_batch_size={self.micro_batch_size} x {self.world} data-parallel ranks = {per_step}: "
                    "the sample order could not continue exactly"
                )
            state = {**state, "index": consumed // per_step, "world": self.world, "micro_batch_size": self.micro_batch_size}
            if state["index"] >= self.steps_per_epoch:  # this layout's epoch ends before the prefix does
                state.update(epoch=int(state["epoch"]) + 1, index=0)
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has {key}={getattr(self, key)!r}: "
                    "resuming would not continue the same sample order"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise ValueError(f"loader state epoch={epoch} index={index} out of range ({self.steps_per_epoch} steps/epoch)")
        self.epoch, self.index = epoch, index
