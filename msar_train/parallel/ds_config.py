"""The one place that turns ``cfg.parallel`` (+ trainer fields) into a DeepSpeed config dict."""

from __future__ import annotations

import copy

import torch
from omegaconf import DictConfig, OmegaConf


def resolve_dtype(p: DictConfig, device_type: str) -> torch.dtype:
    if p.dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return torch.bfloat16 if p.dtype == "bfloat16" else torch.float32


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(cfg: DictConfig, world_size: int, device_type: str) -> dict:
    p, t = cfg.parallel, cfg.trainer
    dp = world_size // p.pp_stages
    ds = {
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.grad_accum,
        "train_batch_size": p.micro_batch_size * p.grad_accum * dp,
        # grad_clip 0 = no clipping; a huge threshold keeps DeepSpeed computing the norm we log.
        "gradient_clipping": float(t.grad_clip) if t.grad_clip > 0 else 1e12,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": resolve_dtype(p, device_type) == torch.bfloat16},
        "steps_per_print": 10**9,  # our own metrics path logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        # The optimizer is a torch AdamW passed to deepspeed.initialize: nothing gets JIT-built.
        "zero_allow_untested_optimizer": True,
    }
    if p.pp_stages > 1:
        ds["pipeline"] = {"activation_checkpoint_interval": 1 if p.activation_checkpointing else 0}
    overrides = OmegaConf.to_container(p.deepspeed_overrides, resolve=True) if p.deepspeed_overrides else {}
    return _merge(ds, overrides)
