"""Registers the structured schemas in Hydra's ConfigStore so every YAML is type-checked on merge."""

from hydra.core.config_store import ConfigStore

from msar_train.config.schema import TrainConfig

_done = False


def register_schemas() -> None:
    global _done
    if not _done:
        ConfigStore.instance().store(name="train_schema", node=TrainConfig)
        _done = True
