"""Small model builders shared by the unit tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from omegaconf import OmegaConf

from msar_train.config.schema import ModelConfig, MoEConfig, ResidualConfig
from msar_train.model.transformer import Transformer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RESIDUAL_PRESETS = sorted(p.stem for p in (CONFIGS / "residual").glob("*.yaml"))
SCRIPTS = CONFIGS.parent / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (a fresh one per call)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def preset(name: str, **over) -> ResidualConfig:
    node = OmegaConf.merge(OmegaConf.structured(ResidualConfig), OmegaConf.load(CONFIGS / "residual" / f"{name}.yaml"), over)
    return OmegaConf.to_object(node)


def model_cfg(n_layers: int = 4, **over) -> ModelConfig:
    moe = MoEConfig(n_routed=4, n_shared=1, top_k=2, expert_hidden=16, score_func="sigmoid", norm_topk_prob=True)
    base = dict(
        vocab_size=64, d_model=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, max_seq_len=64, first_k_dense=1, dense_hidden=32, moe=moe
    )
    base.update(over)
    return ModelConfig(**base)


def build(res: ResidualConfig, n_layers: int = 4, dtype=torch.float64, seed: int = 0, document_mask: bool = False, **over) -> Transformer:
    return Transformer(model_cfg(n_layers, **over), res, document_mask=document_mask, seed=seed).to(dtype)


@torch.no_grad()
def perturb_residual(model: Transformer, seed: int = 1, scale: float = 0.5) -> None:
    """Move residual parameters off their (often degenerate) init so the math is exercised."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for name, p in model.named_parameters():
        if ("_site." in name or name.startswith("head.exit.")) and id(p) not in seen:
            seen.add(id(p))
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)


def ids(batch: int = 2, seq: int = 12, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
