"""Data pipeline: corpus preparation to token shards, packed resumable per-rank loaders.

Public API (imported lazily, so ``msar_train.data.prepare`` and its worker processes do not pay
for importing torch):

* `build_data(data_cfg, model_vocab_size, seed, micro_batch_size, rank=0, world=1) -> DataBundle`
* `DataBundle`, `PackedLoader`, `MixtureLoader`, `PackedDataset`, `Batch` (see `build.py`, `loader.py`,
  `mixture.py`, `packed.py`)
* `prepare(PrepareConfig)` / `msar_train.data.prepare.main(argv)` (CLI ``msar-prepare-data``)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from msar_train.data.build import DataBundle, build_data
    from msar_train.data.loader import Batch, PackedLoader
    from msar_train.data.mixture import MixtureLoader
    from msar_train.data.packed import PackedDataset
    from msar_train.data.prepare import PrepareConfig, prepare

_EXPORTS = {
    "build_data": "msar_train.data.build",
    "DataBundle": "msar_train.data.build",
    "PackedLoader": "msar_train.data.loader",
    "Batch": "msar_train.data.loader",
    "MixtureLoader": "msar_train.data.mixture",
    "PackedDataset": "msar_train.data.packed",
    "PrepareConfig": "msar_train.data.prepare",
    "prepare": "msar_train.data.prepare",
}
__all__ = ["Batch", "DataBundle", "MixtureLoader", "PackedDataset", "PackedLoader", "PrepareConfig", "build_data", "prepare"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'msar_train.data' has no attribute {name!r}")
