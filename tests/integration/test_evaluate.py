"""``msar-eval``: the trainer's ``val/loss`` for the same batches, exact bytes per token, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from msar_train.export.evaluate import main as eval_main
from msar_train.export.evaluate import token_bytes
from msar_train.train.metrics import read_metrics
from tests.distributed._launch import REPO, env

COMMON = [
    "model=tiny",
    "residual=msar",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "trainer.max_steps=4",
    "trainer.warmup_steps=1",
    "trainer.eval_every=4",
    "trainer.eval_batches=3",
    "trainer.save_every=4",
    "trainer.progress=false",
    "logger.mode=disabled",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    cmd = [sys.executable, "-m", "msar_train.train", *COMMON, f"trainer.run_dir={out}"]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _eval(capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = eval_main(list(args))
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


def test_equals_the_trainers_val_loss_for_the_same_batches(run_dir, capsys):
    val = [r["val/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val/loss" in r and r["step"] == 4]
    assert val, "the run logged no val/loss at step 4"
    rc, out, err = _eval(capsys, str(run_dir), "batches=3")
    assert rc == 0, err
    assert out["step"] == 4 and out["batches"] == 3 and out["tokens"] == 3 * 2 * 32
    assert out["loss"] == pytest.approx(val[-1], rel=1e-6)
    assert out["token_loss"] == pytest.approx(out["loss"], rel=1e-12)  # packed batches: same tokens each
    assert out["perplexity"] == pytest.approx(math.exp(out["token_loss"]))
    # bits per byte from the reported sums: nats / (ln 2 * bytes); bytes per token of Shakespeare BPE-4096 > 1
    assert out["bits_per_byte"] == pytest.approx(out["token_loss"] * out["tokens"] / (math.log(2) * out["bytes"]))
    assert 1.5 < out["bytes"] / out["tokens"] < 8


@pytest.mark.slow  # ~70 s: the whole validation split of the built-in corpus
def test_whole_split_by_default(run_dir, capsys):
    rc, out, err = _eval(capsys, str(run_dir))
    assert rc == 0, err
    assert out["batches"] > 3 and out["split"] == "validation" and math.isfinite(out["bits_per_byte"])


def test_token_bytes_are_the_texts_utf8_bytes(run_dir):
    """Exact per token, against decoding a whole document (multi-byte characters included)."""
    from msar_train.data.tokenizer import train_bpe

    text = "Mañana — naïve café, 東京 and emoji 🎭 ROMEO: O, she doth teach the torches to burn bright! " * 3
    tok = train_bpe([text, "plain ascii words for merges " * 20], vocab_size=300)
    tok.encode_special_tokens = True
    ids = tok.encode(text + "<|endoftext|>").ids
    nb = token_bytes(tok, 300)
    assert int(nb[np.array(ids)].sum()) == len(text.encode("utf-8")) + len(b"<|endoftext|>")  # literal text
    eos = tok.token_to_id("<|endoftext|>")
    assert nb[eos] == 0  # the special token itself holds no text


@pytest.mark.parametrize(
    "args,needle",
    [
        (["{run}", "split=train"], "split='train'"),
        (["{run}", "split=test"], "has no test split"),
        (["{run}", "batches=0"], "batches=0"),
        (["{run}", "batches=many"], "batches='many'"),
        (["{run}", "color=red"], "unknown argument color="),
        (["{run}", "data.path=/nonexistent/dir"], "data.path=/nonexistent/dir"),
        (["/nonexistent/run"], "/nonexistent/run"),
        ([], "usage: msar-eval"),
    ],
)
def test_bad_input_exits_2_naming_it(run_dir, capsys, args, needle):
    rc, _, err = _eval(capsys, *[a.format(run=run_dir) for a in args])
    assert rc == 2 and err.startswith("msar-eval: ") and needle in err, err
    assert len(err.strip().splitlines()) == 1


def test_console_script_prints_one_json_line(run_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "msar_train.export.evaluate", str(run_dir), "batches=1"],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert json.loads(line)["batches"] == 1


def test_exported_folder_scores_the_same(run_dir, tmp_path, capsys):
    """msar-eval on the msar-export folder of the run: the same numbers for the same batches; data
    whose tokenizer is not the folder's is refused naming data.path."""
    from msar_train.export.hf import export
    from tests.unit.test_data_mixture import prepare_corpora

    out = tmp_path / "hf"
    export(run_dir, out)
    rc, ref, err = _eval(capsys, str(run_dir), "batches=3")
    assert rc == 0, err
    rc, got, err = _eval(capsys, str(out), f"data.path={ref['data_path']}", "data.seq_len=32", "micro_batch_size=2", "batches=3")
    assert rc == 0, err
    for k in ("loss", "token_loss", "bits_per_byte", "tokens", "bytes"):
        assert got[k] == pytest.approx(ref[k], rel=1e-6), k
    (tmp_path / "corpora").mkdir()
    other = prepare_corpora(tmp_path / "corpora")["other"]
    rc, _, err = _eval(capsys, str(out), f"data.path={other}", "data.seq_len=16", "micro_batch_size=1")
    assert rc == 2 and f"data.path={other}" in err and "tokenizer" in err, err
    assert len(err.strip().splitlines()) == 1, err  # no progress bars around the message
