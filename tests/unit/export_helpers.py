"""Tiny training checkpoints without a training run, for the export tests.

``make_run`` writes what the trainer writes for a plain (single-stage, no ZeRO-3) layout and what
``consolidate`` reads: ``RUN_DIR/checkpoints/step00000001/mp_rank_00_model_states.pt`` with the module
state and the msar client state (resolved config, git commit), a verified ``manifest.json`` with the
tokenizer's sha256, and a prepared-data-like dir (``tokenizer.json`` + ``meta.json``) named by
``data.path``. The model is a perturbed tiny Transformer, so every residual parameter matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from msar_train.config import compose_config
from msar_train.data.io import sha256_file
from msar_train.data.tokenizer import find_eos, tokenizer_bytes, train_bpe, vocab_size
from msar_train.model.transformer import Transformer
from msar_train.train import checkpoint as ckpt
from tests.unit.helpers import perturb_residual

TEXTS = [
    "To be, or not to be, that is the question: whether tis nobler in the mind to suffer.",
    "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "All the world's a stage, and all the men and women merely players.",
] * 20
VOCAB = 320  # the model's; the tokenizer has at most this many


def tiny_overrides(residual: str, **over) -> list[str]:
    base = {
        "model.vocab_size": VOCAB,
        "model.d_model": 16,
        "model.n_layers": 4,
        "model.n_heads": 2,
        "model.n_kv_heads": 1,
        "model.max_seq_len": 64,
        "model.dense_hidden": 32,
        "model.moe.n_routed": 4,
        "model.moe.top_k": 2,
        "model.moe.expert_hidden": 16,
    }
    base.update(over)
    return [f"residual={residual}", "data.seq_len=32", *(f"{k}={v}" for k, v in base.items())]


def make_data_dir(root: Path) -> Path:
    d = root / "data"
    if (d / "tokenizer.json").is_file():
        return d
    d.mkdir(parents=True)
    tok = train_bpe(TEXTS, 300, min_frequency=2)
    (d / "tokenizer.json").write_bytes(tokenizer_bytes(tok))
    meta = {"eos_id": find_eos(tok)[1], "vocab_size": vocab_size(tok), "tokenizer_sha256": sha256_file(d / "tokenizer.json")}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def make_run(root: Path, residual: str = "msar", name: str | None = None, **over) -> tuple[Path, Transformer]:
    """``(run dir, the fp32 Transformer whose weights it holds)``."""
    data = make_data_dir(root)
    cfg = compose_config([*tiny_overrides(residual, **over), f"data.path={data}"])
    model = Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=cfg.trainer.seed)
    perturb_residual(model, seed=3, scale=0.3)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.expert_bias.normal_(0, 0.05)
    run = root / (name or residual)
    d = run / "checkpoints" / ckpt.tag_for(1)
    d.mkdir(parents=True)
    client = {"format": ckpt.FORMAT_VERSION, "step": 1, "config": OmegaConf.to_container(cfg, resolve=True), "git_commit": "abc123"}
    torch.save({"module": model.state_dict(), ckpt.CLIENT_KEY: client}, d / "mp_rank_00_model_states.pt")
    sha = sha256_file(data / "tokenizer.json")
    ckpt.write_manifest(d, 1, ckpt.file_entries(d, ckpt.payload_files(d)), config=client["config"], tokenizer_sha256=sha)
    ckpt.atomic_write_text(run / "checkpoints" / ckpt.LATEST, d.name)
    return run, model.eval()
