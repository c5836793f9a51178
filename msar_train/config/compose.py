"""Compose ``configs/train.yaml`` + overrides into a validated ``DictConfig``.

We use Hydra's compose API rather than ``@hydra.main``: no working-directory change, no Hydra output
folders, and the same call serves the CLIs, the tests and the DeepSpeed launcher (which appends
``--local_rank``). Unknown keys and wrong types fail inside Hydra (struct mode, typed schema);
cross-field checks run in ``validate``; both raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from msar_train.config.store import register_schemas
from msar_train.config.validate import validate


def config_dir() -> Path:
    """``$MSAR_CONFIG_DIR`` or the repository's ``configs/``."""
    env = os.environ.get("MSAR_CONFIG_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "configs"
    if not (path / "train.yaml").is_file():
        raise FileNotFoundError(f"no train.yaml in config dir {path} (set MSAR_CONFIG_DIR)")
    return path


def compose_config(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(overrides or []))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise ValueError(f"invalid config: {e}{cause}") from e
    validate(cfg)
    return cfg
