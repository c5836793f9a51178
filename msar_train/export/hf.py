"""``msar-export RUN_DIR|CHECKPOINT OUT_DIR [dtype=fp32|bf16] [shard_size=5GB] [overwrite=true] [tokenizer=PATH] [kernel=torch]``.

Writes a folder that ``transformers`` loads with ``AutoConfig`` / ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained(OUT_DIR, trust_remote_code=True)``::

    config.json                  MsarConfig: every field of the run's model.* and residual.*, data.document_mask,
                                 auto_map, msar_version / msar_git_commit (the exporter), train_git_commit
    model.safetensors            the consolidated weights (train/consolidate.py: any training layout), or
    model-0000k-of-0000n.safetensors + model.safetensors.index.json when larger than shard_size
    generation_config.json       bos / eos / pad of the tokenizer, use_cache=true (DecodeCache)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   PreTrainedTokenizerFast (eos set)
    configuration_msar.py, modeling_msar.py                          the remote code (this package's files)

The tokenizer is the one the run trained on: ``tokenizer.json`` of its prepared data dir (``data.path``,
``data.mixture[0].path``, or the built-in corpus' dir under ``data.cache_dir``), checked against the
checkpoint's recorded sha256; ``tokenizer=PATH`` names another place (a moved data dir).
``kernel=torch|triton|compile`` sets ``residual.kernel`` of the folder (default: the run's; how depth
attention is computed, not what).

Everything is written into ``.OUT_DIR.tmp-<pid>`` next to ``OUT_DIR`` and renamed at the end, so a
failed export leaves nothing behind. Exit status 2 on bad input (one line naming the path or field):
a missing or corrupt checkpoint, a non-empty OUT_DIR without ``overwrite=true``, a bad option.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from msar_train.errors import InputError, run_cli

HERE = Path(__file__).resolve().parent
REMOTE_CODE = ("configuration_msar.py", "modeling_msar.py")
AUTO_MAP = {"AutoConfig": "configuration_msar.MsarConfig", "AutoModelForCausalLM": "modeling_msar.MsarForCausalLM"}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
OPTIONS = {"dtype": "fp32", "shard_size": "5GB", "overwrite": "false", "tokenizer": None, "kernel": None}

__all__ = ["export", "hf_config", "load_checkpoint_for_hf", "main", "parse_size", "run_tokenizer", "write_safetensors"]


def parse_size(text: str | int) -> int:
    """``"5GB"`` / ``"200KB"`` / ``"1MiB"`` / ``"4096"`` -> bytes (KB = 1000 B as in transformers, KiB = 1024 B)."""
    m = _SIZE_RE.match(str(text))
    if m is None or float(m[1]) <= 0:
        raise InputError(f"shard_size={text}: not a positive size like 5GB, 200MB, 64KiB or a number of bytes")
    return int(float(m[1]) * _UNITS[(m[2] or "B").upper()])


# ------------------------------------------------------------------------------------ tokenizer
def _tokenizer_dir(cfg) -> Path:
    """The prepared data dir whose tokenizer.json the run trained with."""
    from msar_train.data.build import prepared_dir
    from msar_train.data.io import resolve_cache_dir

    d = cfg.data
    if d.get("mixture"):
        return Path(str(d.mixture[0].path)).expanduser()
    if d.get("path"):
        return Path(str(d.path)).expanduser()
    return prepared_dir(str(d.corpus), int(d.tokenizer_vocab_size), resolve_cache_dir(d.get("cache_dir")))


def run_tokenizer(cfg, manifest: dict[str, Any], override: str | Path | None = None):
    """``(PreTrainedTokenizerFast, eos_id, pad_id)`` of the run that wrote ``cfg`` / ``manifest``.

    ``override``: a tokenizer.json or a folder holding one, instead of the run's data dir."""
    from transformers import PreTrainedTokenizerFast

    from msar_train.data.io import sha256_file
    from msar_train.data.tokenizer import PAD_TOKEN, find_eos, load_tokenizer, pad_id

    where = Path(override).expanduser() if override else _tokenizer_dir(cfg)
    file = where if where.is_file() else where / "tokenizer.json"
    field = "tokenizer" if override else "the run's data dir (data.path / data.mixture / data.corpus)"
    if not file.is_file():
        raise InputError(f"{file}: no tokenizer.json ({field}); name it with tokenizer=PATH")
    recorded = manifest.get("tokenizer_sha256")
    if recorded and sha256_file(file) != recorded:
        raise InputError(
            f"{file}: not the tokenizer the checkpoint was trained with (sha256 differs from the checkpoint's {recorded[:12]}…)"
        )
    try:
        tok = load_tokenizer(file)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    meta_file = file.parent / "meta.json"
    eos_name = None
    if meta_file.is_file():
        eos = json.loads(meta_file.read_text()).get("eos_id")
        eos_name = tok.id_to_token(int(eos)) if eos is not None else None
    eos_name, eos_id = find_eos(tok, eos_name)
    pid = pad_id(tok)
    pad_name = PAD_TOKEN if pid is not None else eos_name
    # Documents are "tokens, EOS" back to back, so EOS is also what precedes a document (GPT-2's use).
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_name,
        bos_token=eos_name,
        pad_token=pad_name,
        model_max_length=int(cfg.model.max_seq_len),
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,  # as in training: "<|endoftext|>" inside a text is ordinary text
    )
    return hf_tok, eos_id, pid if pid is not None else eos_id


# --------------------------------------------------------------------------------------- config
def hf_config(cfg, eos_id: int, pad_id: int, dtype: torch.dtype, train_commit: str | None):
    """The ``MsarConfig`` of a training config (every model.* / residual.* field, data.document_mask)."""
    from omegaconf import OmegaConf

    import msar_train
    from msar_train.export.configuration_msar import MsarConfig
    from msar_train.train.metrics import git_commit

    return MsarConfig(
        msar_model=OmegaConf.to_container(cfg.model, resolve=True),
        msar_residual=OmegaConf.to_container(cfg.residual, resolve=True),
        document_mask=bool(cfg.data.document_mask),
        msar_version=msar_train.__version__,
        msar_git_commit=git_commit(HERE),
        train_git_commit=train_commit,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        auto_map=dict(AUTO_MAP),
        architectures=["MsarForCausalLM"],
        dtype=str(dtype).removeprefix("torch."),
    )


def resolve_checkpoint(path: str | Path, prog: str = "msar-export") -> Path:
    """``checkpoint.resolve_model_dir``, with the reasons in the one error line when a run dir holds no
    valid checkpoint (and as warnings when newer ones were skipped for an older valid one)."""
    from msar_train.train.checkpoint import CheckpointError, checkpoint_dirs, newest_valid, resolve_model_dir

    path = Path(path).expanduser()
    for root in (path, path / "checkpoints"):
        if checkpoint_dirs(root) and not (path / "manifest.json").exists():
            rejected: list[str] = []
            found, _ = newest_valid(root, warn=rejected.append)
            if found is None:
                raise CheckpointError(f"{path}: no valid checkpoint in {root} ({'; '.join(r.removeprefix('skipping ') for r in rejected)})")
            for r in rejected:
                print(f"{prog}: warning: {r}", file=sys.stderr)
            return found
    return resolve_model_dir(path)


def load_checkpoint_for_hf(path: str | Path, tokenizer: str | Path | None = None, prog: str = "msar-export"):
    """``(state_dict of the Transformer, MsarConfig in fp32, tokenizer)`` of a training checkpoint."""
    from msar_train.train.checkpoint import CLIENT_KEY, MANIFEST
    from msar_train.train.consolidate import consolidate, load_file, model_states_file

    ckpt = resolve_checkpoint(path, prog)
    state, cfg = consolidate(ckpt)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    tok, eos_id, pad = run_tokenizer(cfg, manifest, tokenizer)
    client = load_file(model_states_file(ckpt, 0)).get(CLIENT_KEY, {})
    return state, hf_config(cfg, eos_id, pad, torch.float32, client.get("git_commit")), tok


# -------------------------------------------------------------------------------------- weights
def write_safetensors(state: dict[str, torch.Tensor], out: Path, shard_size: int) -> list[str]:
    """``state`` as ``model.safetensors``, or shards + ``model.safetensors.index.json`` when its bytes
    exceed ``shard_size`` (a tensor larger than a shard gets a shard of its own). Returns the files."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in state.items():
        # own storage per name: safetensors refuses shared tensors (MSAR's aliased parameters)
        t = t.detach().contiguous().clone()
        n = t.numel() * t.element_size()
        if shards[-1] and used + n > shard_size:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += n
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, "model.safetensors.index.json"]


def _hf_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Transformer names -> MsarForCausalLM names; floating parameters cast to ``dtype`` (buffers such
    as MoE's router bias keep theirs: the model keeps them in fp32)."""
    return {f"model.{k}": v.to(dtype) if v.is_floating_point() and not k.endswith("expert_bias") else v for k, v in state.items()}


# --------------------------------------------------------------------------------------- export
def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{out}: exists and is not empty; pass overwrite=true to replace it")


def export(
    path: str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    shard_size: str | int = "5GB",
    overwrite: bool = False,
    tokenizer: str | Path | None = None,
    kernel: str | None = None,
) -> Path:
    """Export the training checkpoint at ``path`` (checkpoint, checkpoints/ or run dir) to ``out_dir``.

    ``kernel``: ``residual.kernel`` of the exported model (default: the run's). It changes how depth
    attention is computed, not what (a resume may change it too), e.g. ``torch`` for a run trained with
    ``triton`` whose folder is meant for machines without Triton."""
    from transformers import GenerationConfig

    from msar_train.kernels.dispatch import KERNELS

    if str(dtype) not in DTYPES:
        raise InputError(f"dtype={dtype}: not one of fp32, bf16")
    torch_dtype = DTYPES[str(dtype)]
    limit = parse_size(shard_size)
    out = Path(out_dir).expanduser().absolute()
    _check_out_dir(out, overwrite)
    if kernel is not None and kernel not in KERNELS:
        raise InputError(f"kernel={kernel}: not one of {', '.join(KERNELS)}")
    state, config, tok = load_checkpoint_for_hf(path, tokenizer)
    config.dtype = str(torch_dtype).removeprefix("torch.")
    if kernel is not None and "kernel" in config.msar_residual:
        config.msar_residual["kernel"] = kernel

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        config.save_pretrained(tmp)
        write_safetensors(_hf_state(state, torch_dtype), tmp, limit)
        GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, use_cache=True
        ).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # transformers 5 names its fast tokenizer class TokenizersBackend; 4.x knows only this name, 5 both
        tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        if not (tmp / "special_tokens_map.json").is_file():  # transformers 5 folds it into tokenizer_config.json
            specials = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token") if getattr(tok, k, None)}
            (tmp / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        for name in REMOTE_CODE:
            shutil.copyfile(HERE / name, tmp / name)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (empty, or replaced under overwrite) goes last."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------ CLI
def parse_options(args: list[str], known: dict[str, Any], prog: str) -> dict[str, Any]:
    """``key=value`` arguments -> ``known`` updated; an unknown key or a bare word is an ``InputError``."""
    opts = dict(known)
    for a in args:
        key, sep, value = a.partition("=")
        if not sep or key not in known:
            raise InputError(f"{a}: not an option of {prog} ({', '.join(f'{k}=...' for k in known)})")
        opts[key] = value
    return opts


def _bool(text: str, field: str) -> bool:
    v = str(text).strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise InputError(f"{field}={text}: not true or false")


def _main(args: list[str]) -> str:
    positional = [a for a in args if "=" not in a]
    if len(positional) != 2:
        raise InputError(f"expected RUN_DIR|CHECKPOINT and OUT_DIR, got {len(positional)} positional arguments")
    opts = parse_options([a for a in args if "=" in a], OPTIONS, "msar-export")
    out = export(
        positional[0],
        positional[1],
        dtype=opts["dtype"],
        shard_size=opts["shard_size"],
        overwrite=_bool(opts["overwrite"], "overwrite"),
        tokenizer=opts["tokenizer"],
        kernel=opts["kernel"],
    )
    return f"exported to {out}"


def main(argv: list[str] | None = None) -> int:
    return run_cli("msar-export", __doc__, argv, _main)


if __name__ == "__main__":
    sys.exit(main())
