"""Registers the structured schemas in Hydra's ConfigStore so every YAML is type-checked on merge."""

import hashlib

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from msar_train.config.schema import TrainConfig

_done = False
MAX_NAME = 200


def short_name(name: str) -> str:
    """A multirun job name that fits in a file name: kept up to ``MAX_NAME`` characters, else its
    first 180 and a hash of the whole; ``/`` becomes ``_`` (the ``msar_dirname`` resolver of ``hydra.sweep.subdir``)."""
    name = name.replace("/", "_")  # a path in an override (data.path=...) would nest directories
    if len(name) <= MAX_NAME:
        return name
    return f"{name[:180]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def register_schemas() -> None:
    global _done
    if not _done:
        ConfigStore.instance().store(name="train_schema", node=TrainConfig)
        if not OmegaConf.has_resolver("msar_dirname"):
            OmegaConf.register_new_resolver("msar_dirname", short_name)
        _done = True
