"""``msar-eval RUN_DIR|CHECKPOINT|HF_DIR [data.path=DIR] [split=validation|test] [batches=N] [micro_batch_size=B]``

Scores a trained model on a prepared split and prints one JSON line:

* ``loss``: the mean over batches of each batch's mean next-token cross-entropy, the trainer's
  ``val/loss`` definition (with ``batches=trainer.eval_batches`` and the run's micro-batch size it is
  the same number for the same batches);
* ``token_loss``: nats per predicted token over all of them (equal to ``loss`` when every batch
  predicts the same number of tokens, as packed batches do) and ``perplexity = exp(token_loss)``;
* ``bits_per_byte``: total nats / (ln 2 * UTF-8 bytes of the predicted tokens), comparable across
  tokenizers. Every tokenizer here is byte-level (``data/tokenizer.py``), so each token's bytes are
  exact, also for tokens that hold part of a multi-byte character; special tokens (EOS) hold no text
  and count 0 bytes, their nats still count.

The model is the single-process ``Transformer`` consolidated from any training layout
(``train/consolidate.py``), or the one inside a folder written by ``msar-export`` (loaded through
``transformers``). The data defaults to the run's own ``data`` config (``data.*=...`` overrides any
of its fields, e.g. another prepared directory with the same tokenizer); an exported folder has no
data config, so it starts from the defaults (``data.path=DIR`` for a prepared directory, else the
built-in corpus) with the folder's document masking, and the data's tokenizer must be the folder's.
By default every batch of the split is scored (``batches=all``).

Exit status: 0; 2 bad input (an unknown argument, a missing or damaged checkpoint, a data directory
without the split, a tokenizer larger than the model's vocabulary), one line naming it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from msar_train.errors import EXIT_BAD_INPUT
from msar_train.export.generate import is_hf_dir

SPLITS = ("validation", "test")
_OPTIONS = ("split", "batches", "micro_batch_size")


def _byte_level_inverse() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other 68
    bytes for code points 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def token_bytes(tok, vocab: int) -> np.ndarray:
    """UTF-8 bytes of every token id below ``vocab``: byte-level tokens by their alphabet, special
    (added) tokens 0, any other token (a tokenizer that is not byte-level) by its decoded text."""
    inverse = _byte_level_inverse()
    special = {t.content for t in tok.get_added_tokens_decoder().values()} if hasattr(tok, "get_added_tokens_decoder") else set()
    out = np.zeros(vocab, dtype=np.int64)
    for i in range(vocab):
        s = tok.id_to_token(i)
        if s is None or s in special:
            continue
        if all(c in inverse for c in s):
            out[i] = len(s)
        else:
            out[i] = len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out


@torch.no_grad()
def score(model, batches, document_mask: bool, nbytes: np.ndarray) -> dict[str, float]:
    """Sums and means over ``batches`` (``data.loader.Batch``) of the model's next-token loss."""
    per_batch, nats, tokens, text_bytes = [], 0.0, 0, 0
    lut = torch.from_numpy(nbytes)
    for b in batches:
        x = (b.input_ids_BT, b.doc_ids_BT, b.positions_BT) if document_mask else (b.input_ids_BT,)
        logits_BTV, _aux = model(*x)
        labels = b.labels_BT.reshape(-1)
        flat = logits_BTV.float().reshape(-1, logits_BTV.shape[-1])
        ce = F.cross_entropy(flat, labels, ignore_index=-100, reduction="none")
        keep = labels != -100
        n = int(keep.sum())
        if n == 0:
            continue
        s = float(ce[keep].double().sum())
        per_batch.append(s / n)
        nats += s
        tokens += n
        text_bytes += int(lut[labels[keep]].sum())
    if not per_batch:
        raise ValueError("no batch to score: the split is shorter than one micro-batch of seq_len + 1 tokens")
    token_loss = nats / tokens
    return {
        "batches": len(per_batch),
        "tokens": tokens,
        "bytes": text_bytes,
        "loss": float(np.mean(per_batch)),
        "token_loss": token_loss,
        "perplexity": math.exp(token_loss),
        "bits_per_token": token_loss / math.log(2),
        "bits_per_byte": nats / (math.log(2) * text_bytes) if text_bytes else float("nan"),
    }


def _parse(args: list[str]) -> tuple[str, dict[str, str], list[str]]:
    if not args or "=" in args[0]:
        raise ValueError(
            "usage: msar-eval RUN_DIR|CHECKPOINT|HF_DIR [data.path=DIR] [split=validation|test] [batches=N] [micro_batch_size=B]"
        )
    path, opts, data = args[0], {}, []
    for a in args[1:]:
        key, sep, value = a.partition("=")
        if not sep:
            raise ValueError(f"argument {a!r}: expected key=value")
        if key.startswith("data."):
            data.append(a)
        elif key in _OPTIONS:
            opts[key] = value
        else:
            raise ValueError(f"unknown argument {key}= (known: {', '.join(_OPTIONS)}, data.<field>)")
    return path, opts, data


def _positive_int(opts: dict[str, str], key: str, default: int | None) -> int | None:
    v = opts.get(key)
    if v is None or (key == "batches" and v == "all"):
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{key}={v!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{key}={n} must be >= 1")
    return n


def run(args: list[str]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from msar_train.data.build import build_data
    from msar_train.data.tokenizer import load_tokenizer
    from msar_train.train.checkpoint import load_model, resolve_model_dir

    path, opts, data_over = _parse(args)
    split = opts.get("split", "validation")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(SPLITS)}")
    n_batches = _positive_int(opts, "batches", None)
    hf = is_hf_dir(Path(path))
    if hf:
        model, cfg, ckpt_dir = _load_hf(Path(path))
    else:
        ckpt_dir = resolve_model_dir(path)
        model, cfg = load_model(ckpt_dir)
    if data_over:
        OmegaConf.set_struct(cfg, False)
        try:
            cfg.data = OmegaConf.merge(cfg.data, OmegaConf.from_dotlist([a[len("data.") :] for a in data_over]))
        except Exception as e:  # an omegaconf type error names the field
            raise ValueError(f"data override: {e}") from None
    micro = _positive_int(opts, "micro_batch_size", int(cfg.parallel.micro_batch_size))
    bundle = build_data(cfg.data, int(cfg.model.vocab_size), int(cfg.trainer.seed), micro)
    loader = bundle.val if split == "validation" else bundle.test
    if loader is None:
        raise ValueError(f"split={split}: {bundle.path} has no {split} split")
    tok = load_tokenizer(bundle.path / bundle.meta.get("tokenizer_file", "tokenizer.json"))
    if hf and load_tokenizer(ckpt_dir).get_vocab(with_added_tokens=True) != tok.get_vocab(with_added_tokens=True):
        raise ValueError(f"data.path={bundle.path}: its tokenizer is not the one of {ckpt_dir} (tokenizer.json); prepare the data with it")
    nbytes = token_bytes(tok, int(cfg.model.vocab_size))
    out = score(model, loader.batches(n_batches), bool(cfg.data.document_mask), nbytes)
    manifest = ckpt_dir / "manifest.json"
    step = json.loads(manifest.read_text()).get("step") if manifest.is_file() else None
    return {"checkpoint": str(ckpt_dir), "step": step, "data_path": str(bundle.path), "split": split, "micro_batch_size": micro, **out}


def _load_hf(path: Path):
    """(the exported folder's ``Transformer``, a config with its model and residual and the default
    data / parallel groups, the folder)."""
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from msar_train.config import compose_config
    from msar_train.export.generate import load

    hf_logging.disable_progress_bar()  # stdout is one JSON line, stderr at most one message
    hf_model, _tok = load(path)
    config = hf_model.config
    folder = {
        "model": dict(config.msar_model),
        "residual": dict(config.msar_residual),
        "data": {"document_mask": bool(config.document_mask)},
    }
    cfg = OmegaConf.merge(compose_config([]), folder)
    return hf_model.model.float().eval(), cfg, path


def main(argv: list[str] | None = None) -> int:
    from msar_train.train.checkpoint import CheckpointError

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    try:
        result = run(args)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"msar-eval: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
