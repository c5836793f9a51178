"""Config schemas, Hydra registration, composition and cross-field validation."""

from msar_train.config.compose import compose_config, config_dir
from msar_train.config.validate import validate

__all__ = ["compose_config", "config_dir", "validate"]
