"""``msar-generate RUN_DIR|CHECKPOINT|HF_DIR prompt="..." max_new_tokens=N [temperature=T] [top_k=K] [top_p=P] [seed=S]``.

Prints the prompt followed by its continuation. ``HF_DIR`` is a folder written by ``msar-export``
(loaded through ``transformers`` with ``trust_remote_code``); anything else is a training checkpoint,
a ``checkpoints/`` dir or a run dir (its newest valid checkpoint, consolidated from any layout, with the
tokenizer of its data dir). Both go through the same ``MsarForCausalLM.generate``: greedy without
``temperature`` (or with 0), else sampling with ``transformers``' temperature / top-k / top-p processors.
Cached: each new token runs one incremental forward (``DecodeCache``), not the whole prefix.

Exit status 2 on bad input, one line naming it: a missing or corrupt checkpoint, a bad option, a
prompt longer than the model's ``max_seq_len`` tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from msar_train.errors import InputError, run_cli
from msar_train.export.hf import load_checkpoint_for_hf, parse_options

OPTIONS = {"prompt": None, "max_new_tokens": "32", "temperature": "0", "top_k": "0", "top_p": "1.0", "seed": "0", "tokenizer": None}


def is_hf_dir(path: Path) -> bool:
    import json

    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("model_type") == "msar"
    except ValueError:
        return False


def load(path: str | Path, tokenizer: str | Path | None = None):
    """``(MsarForCausalLM in eval mode, tokenizer)`` of an exported folder or a training checkpoint."""
    path = Path(path).expanduser()
    if is_hf_dir(path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
        return model.eval(), AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=True)
    from msar_train.export.modeling_msar import MsarForCausalLM

    state, config, tok = load_checkpoint_for_hf(path, tokenizer, prog="msar-generate")
    model = MsarForCausalLM(config)
    model.model.load_state_dict(state, strict=True)
    return model.float().eval(), tok


def _number(opts: dict, key: str, kind: type):
    try:
        return kind(opts[key])
    except (TypeError, ValueError):
        raise InputError(f"{key}={opts[key]}: not a{'n integer' if kind is int else ' number'}") from None


def generate(
    model, tok, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0
) -> str:
    """The decoded prompt + continuation (stops early at EOS)."""
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"]
    limit = int(model.config.max_position_embeddings)
    if ids.shape[1] == 0:
        raise InputError("prompt: empty (nothing to continue)")
    if ids.shape[1] > limit:
        raise InputError(f"prompt: {ids.shape[1]} tokens, longer than the model's max_seq_len={limit}")
    if ids.shape[1] + max_new_tokens > limit:
        print(f"msar-generate: warning: prompt + max_new_tokens = {ids.shape[1] + max_new_tokens} > max_seq_len={limit}", file=sys.stderr)
    sample = temperature > 0
    kwargs = dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p) if sample else dict(do_sample=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, use_cache=True, **kwargs)
    return tok.decode(out[0], skip_special_tokens=True)


def _main(args: list[str]) -> str:
    src, *rest = args
    opts = parse_options(rest, OPTIONS, "msar-generate")
    if opts["prompt"] is None:
        raise InputError('prompt="...": required')
    n, temperature = _number(opts, "max_new_tokens", int), _number(opts, "temperature", float)
    top_k, top_p, seed = _number(opts, "top_k", int), _number(opts, "top_p", float), _number(opts, "seed", int)
    if n < 1:
        raise InputError(f"max_new_tokens={n}: must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise InputError(f"temperature={temperature} top_k={top_k} top_p={top_p}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")
    model, tok = load(src, opts["tokenizer"])
    return generate(model, tok, opts["prompt"], n, temperature, top_k, top_p, seed)


def main(argv: list[str] | None = None) -> int:
    return run_cli("msar-generate", __doc__, argv, _main)


__all__ = ["generate", "is_hf_dir", "load", "main"]

if __name__ == "__main__":
    sys.exit(main())
