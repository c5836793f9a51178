"""Checkpoints: DeepSpeed's files plus a verified manifest, in ``RUN_DIR/checkpoints/<tag>/``.

Layout of one checkpoint (``tag = step<N:08d>``)::

    checkpoints/
      latest                   the tag of the newest verified checkpoint (ours, written atomically)
      step00000100/
        mp_rank_00_model_states.pt | layer_XX-*model_states.pt | expp_rank_*  (DeepSpeed: module,
        *optim_states.pt                                                         optimizer, schedule)
        manifest.json          written last: {step, tag, files: {relpath: {size, sha256}}}

The client state saved through DeepSpeed (key ``msar``) holds the step, the train loader position,
the RNG states of every rank (python, numpy, torch), the resolved config, the git commit and the
wandb run id. Router biases (``expert_bias``) are persistent module buffers: DeepSpeed saves them with
the module (plain state dict, pipeline layer files and expert files alike).

A checkpoint is *valid* when its ``manifest.json`` exists and every file it lists has the recorded size
and sha256. A directory without a manifest is an *incomplete* save (the process died while saving);
a manifest that disagrees with the files is a *corrupted* checkpoint. Both are refused by name.
DeepSpeed's own ``latest`` file is not written (``save_latest=False``); ours has the same name and
format (the tag), so ``engine.load_checkpoint(dir)`` without a tag would still find it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from msar_train.errors import InputError

TAG_RE = re.compile(r"^step(\d{8})$")
MANIFEST = "manifest.json"
LATEST = "latest"
CLIENT_KEY = "msar"
FORMAT_VERSION = 1


class CheckpointError(InputError):
    """A checkpoint that cannot be used; the message starts with its path."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(ckpt_dir: Path) -> int | None:
    m = TAG_RE.match(Path(ckpt_dir).name)
    return int(m.group(1)) if m else None


def checkpoint_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and step_of(d) is not None]
    return sorted(dirs, key=step_of, reverse=True)


# ----------------------------------------------------------------------------------- integrity
def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def payload_files(ckpt_dir: Path) -> list[str]:
    """Every file of a checkpoint but its manifest, as sorted paths relative to ``ckpt_dir``."""
    ckpt_dir = Path(ckpt_dir)
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_entries(ckpt_dir: Path, rel_paths: list[str]) -> dict[str, dict[str, Any]]:
    return {r: {"size": (Path(ckpt_dir) / r).stat().st_size, "sha256": sha256_file(Path(ckpt_dir) / r)} for r in rel_paths}


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same directory, fsync, then ``os.replace``: readers see the old
    content or the new one, never a partial file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written temp file
        raise


def write_manifest(ckpt_dir: Path, step: int, entries: dict[str, dict[str, Any]], **extra: Any) -> Path:
    """``extra``: JSON fields stored beside the file list (``config``: the resolved config,
    ``tokenizer_sha256``), which a resume checks without unpickling DeepSpeed's files."""
    ckpt_dir = Path(ckpt_dir)
    manifest = {"format": FORMAT_VERSION, "tag": ckpt_dir.name, "step": int(step), "files": entries, **extra}
    atomic_write_text(ckpt_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return ckpt_dir / MANIFEST


def verify(ckpt_dir: Path, hash_files: bool = True) -> dict[str, Any]:
    """The manifest of a valid checkpoint; ``CheckpointError`` naming the checkpoint and the bad file
    otherwise. ``hash_files=False`` checks presence and sizes only (a truncation, not a bit flip)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    mpath = ckpt_dir / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{ckpt_dir}: incomplete checkpoint (no {MANIFEST}: the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt_dir}: corrupted checkpoint ({mpath.name} unreadable: {e})") from None
    if not files:
        raise CheckpointError(f"{ckpt_dir}: corrupted checkpoint ({MANIFEST} lists no files)")
    for rel, meta in sorted(files.items()):
        f = ckpt_dir / rel
        if not f.is_file():
            raise CheckpointError(f"{ckpt_dir}: corrupted checkpoint (missing file {rel})")
        size = f.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(
                f"{ckpt_dir}: corrupted checkpoint ({rel} has {size} bytes, the manifest says {meta['size']}: truncated?)"
            )
        if hash_files and sha256_file(f) != meta["sha256"]:
            raise CheckpointError(f"{ckpt_dir}: corrupted checkpoint ({rel}: sha256 differs from the manifest)")
    return manifest


def _warn(msg: str) -> None:
    print(f"msar-train: warning: {msg}", file=sys.stderr, flush=True)


def newest_valid(root: Path, warn=_warn) -> tuple[Path | None, list[CheckpointError]]:
    """The newest valid checkpoint under ``root`` (the ``latest`` pointer first, then by step) and
    the checkpoints rejected on the way (each reported through ``warn``)."""
    root = Path(root)
    candidates = checkpoint_dirs(root)
    latest = root / LATEST
    if latest.is_file():
        pointed = root / latest.read_text().strip()
        if pointed in candidates:
            candidates.remove(pointed)
            candidates.insert(0, pointed)
    rejected = []
    for d in candidates:
        try:
            verify(d)
            return d, rejected
        except CheckpointError as e:
            warn(f"skipping {e}")
            rejected.append(e)
    return None, rejected


def resolve_resume(spec: str, root: Path, warn=_warn) -> Path | None:
    """``trainer.resume`` -> the checkpoint directory to load, or None for a fresh start.

    ``none``: fresh. ``auto``: the newest valid checkpoint in ``root`` (RUN_DIR/checkpoints); fresh
    when there is none, unless some were *corrupted* (a manifest that disagrees with its files):
    then it refuses rather than silently restarting from scratch. ``PATH``: a checkpoint directory
    (must be valid) or a checkpoints directory (its newest valid checkpoint).
    """
    spec = str(spec).strip()
    if spec == "none":
        return None
    if spec == "auto":
        found, rejected = newest_valid(root, warn)
        corrupted = [e for e in rejected if "corrupted" in str(e)]
        if found is None and corrupted:
            raise CheckpointError(
                f"trainer.resume=auto: no valid checkpoint in {root}; rejected: "
                + "; ".join(str(e) for e in corrupted)
                + ". Remove them or set trainer.resume=none"
            )
        return found
    path = Path(spec).expanduser()
    if (path / MANIFEST).exists() or step_of(path) is not None:
        try:
            verify(path)
        except CheckpointError as e:
            raise CheckpointError(f"trainer.resume={spec}: {e}") from None
        return path
    if path.is_dir() and (checkpoint_dirs(path) or (path / "checkpoints").is_dir()):
        root = path if checkpoint_dirs(path) else path / "checkpoints"
        found, _ = newest_valid(root, warn)
        if found is None:
            raise CheckpointError(f"trainer.resume={spec}: no valid checkpoint in {root}")
        return found
    raise CheckpointError(f"trainer.resume={spec}: not auto, none, a checkpoint directory or a checkpoints directory")


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest valid (manifest-bearing) checkpoints, and any other
    checkpoint directory older than the oldest one kept. Returns what was deleted."""
    dirs = checkpoint_dirs(root)
    kept = [d for d in dirs if (d / MANIFEST).is_file()][:keep_last]
    if not kept:
        return []
    oldest = step_of(kept[-1])
    gone = [d for d in dirs if d not in kept and step_of(d) < oldest]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def saved_config(ckpt_dir: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(resolved config, tokenizer sha256 or None) of the run that wrote a verified checkpoint: from
    its manifest, or for checkpoints older than that field from the client state in DeepSpeed's
    stage-0 model file."""
    if "config" in manifest:
        return manifest["config"], manifest.get("tokenizer_sha256")
    from omegaconf import OmegaConf

    from msar_train.train.consolidate import _client_cfg

    cfg, _ = _client_cfg(Path(ckpt_dir))
    return OmegaConf.to_container(cfg, resolve=True), None


def saved_world_size(ckpt_dir: Path, manifest: dict[str, Any]) -> int | None:
    """The number of ranks that wrote a verified checkpoint: from its manifest, or for checkpoints
    older than that field from DeepSpeed's stage-0 model file (data-parallel x pipeline degree)."""
    if "world_size" in manifest:
        return int(manifest["world_size"])
    from msar_train.train.consolidate import load_file, model_states_file

    state = load_file(model_states_file(Path(ckpt_dir), 0))
    try:
        return int(state["dp_world_size"]) * int(state["mp_world_size"])
    except (KeyError, TypeError, ValueError):
        return None


def write_failure(err: BaseException, where: Path) -> OSError | None:
    """The OS error behind a failed checkpoint write, or None when ``err`` is not one.

    ``OSError`` is itself; torch's zip writer reports a full disk as ``RuntimeError: [enforce fail at
    inline_container.cc...] unexpected pos`` without the errno, so for that a small probe file is
    written next to the checkpoint to learn the OS's reason (ENOSPC, EIO, EROFS...)."""
    if isinstance(err, OSError):
        return err
    text = str(err)
    if not isinstance(err, RuntimeError) or not any(k in text for k in ("inline_container", "PytorchStreamWriter", "file write failed")):
        return None
    probe = Path(where) / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        return e
    finally:
        probe.unlink(missing_ok=True)
    return OSError(f"the checkpoint writer failed ({text.splitlines()[0][:200]})")


# ------------------------------------------------------------------------------------ RNG state
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------ offline model loading
def resolve_model_dir(path: Path) -> Path:
    """A checkpoint directory, a checkpoints directory or a run directory -> a valid checkpoint."""
    path = Path(path)
    if (path / MANIFEST).exists() or step_of(path) is not None:
        verify(path)
        return path
    for root in (path, path / "checkpoints"):
        if checkpoint_dirs(root):
            found, _ = newest_valid(root)
            if found is None:
                raise CheckpointError(f"{path}: no valid checkpoint in {root}")
            return found
    raise CheckpointError(f"{path}: not a checkpoint, a checkpoints directory or a run directory with checkpoints")


def load_model(path: str | Path):
    """Rebuild the single-process ``Transformer`` of a training checkpoint and load its weights.

    ``path``: a checkpoint directory, a ``checkpoints/`` directory or a run directory (its newest
    valid checkpoint), of any layout (plain, ZeRO, pipeline with any ``virtual_stages``, expert
    parallel, pipeline x expert parallel): ``train/consolidate.py`` gathers the weights. Returns
    ``(model in eval mode on the CPU, cfg)``.
    """
    from msar_train.model.transformer import Transformer
    from msar_train.train.consolidate import consolidate

    state, cfg = consolidate(path)
    model = Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=cfg.trainer.seed)
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg


__all__ = [
    "CheckpointError",
    "checkpoint_dirs",
    "load_model",
    "newest_valid",
    "prune",
    "resolve_model_dir",
    "resolve_resume",
    "rng_state",
    "saved_config",
    "saved_world_size",
    "set_rng_state",
    "tag_for",
    "verify",
    "write_failure",
]
