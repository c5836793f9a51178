"""``data.mixture`` end to end through the msar-train CLI: two small corpora prepared with one tokenizer.

The tokens per source (``data/tokens/<name>``) follow the weights within the schedule's bound (every
count within one row of ``p_s * rows``, ``data/mixture.py``), a stop/resume reproduces the straight
run bit for bit, and a missing source or a tokenizer mismatch exits 2 naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msar_train.train.cli import main
from msar_train.train.metrics import read_metrics
from tests.unit.test_data_mixture import prepare_corpora

B, T, STEPS = 4, 32, 8  # micro batch (one rank), seq_len, steps of the straight run
COMMON = ["model=tiny", f"data.seq_len={T}", f"parallel.micro_batch_size={B}", f"trainer.max_steps={STEPS}",
          "trainer.warmup_steps=2", "trainer.log_every=1", "trainer.eval_every=4", "trainer.eval_batches=1",
          "trainer.save_every=0", "trainer.progress=false", "logger.mode=disabled"]  # fmt: skip


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`a` and `b` (other text) prepared with one tokenizer, `other` with another (see the unit test)."""
    return prepare_corpora(tmp_path_factory.mktemp("mixture-train"))


def _mixture(a: Path, b: Path, wa: float = 0.7, wb: float = 0.3) -> str:
    return f"data.mixture=[{{path: '{a}', weight: {wa}}}, {{path: '{b}', weight: {wb}}}]"


def _train(run_dir: Path, corpora: dict[str, Path], *extra: str) -> list[dict]:
    assert main([*COMMON, _mixture(corpora["a"], corpora["b"]), f"trainer.run_dir={run_dir}", *extra]) == 0
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture(scope="module")
def straight(corpora: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("straight") / "run", corpora)


def test_tokens_per_source_follow_the_weights(straight: list[dict]) -> None:
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1))
    for r in straight:
        a, b = r["data/tokens/a"], r["data/tokens/b"]
        rows = r["step"] * B  # one rank, no accumulation: B rows a step
        assert a + b == rows * T  # every train row is counted once, eval rows are not
        # The largest-deficit schedule keeps each count within one row of p_s * rows at every step,
        # so the token share is within 1 / rows of the weight (1/32 = 0.031 at step 8).
        assert abs(a / T - 0.7 * rows) < 1 and abs(b / T - 0.3 * rows) < 1, r
    last = straight[-1]
    share = last["data/tokens/a"] / (last["data/tokens/a"] + last["data/tokens/b"])
    assert abs(share - 0.7) < 1 / (STEPS * B)


def test_stop_and_resume_equals_the_straight_run(
    corpora: dict[str, Path], straight: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "sliced"
    first = _train(run_dir, corpora, f"trainer.stop_at={STEPS // 2}")
    assert [r["step"] for r in first] == list(range(1, STEPS // 2 + 1))
    capsys.readouterr()
    rows = _train(run_dir, corpora, "trainer.resume=auto")
    assert f"resumed from {run_dir / 'checkpoints' / f'step{STEPS // 2:08d}'}" in capsys.readouterr().out
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    keys = ("train/loss", "train/total_loss", "grad_norm", "data/tokens/a", "data/tokens/b", "val/loss")
    for got, ref in zip(rows, straight, strict=True):
        for k in keys:
            assert got.get(k) == ref.get(k), (got["step"], k, got.get(k), ref.get(k))


@pytest.mark.parametrize("bad", ["missing", "other"])
def test_bad_source_exits_2_naming_the_field(corpora: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture, bad: str) -> None:
    second = tmp_path / "nowhere" if bad == "missing" else corpora["other"]
    rc = main([*COMMON, _mixture(corpora["a"], second), f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    want = "not a directory" if bad == "missing" else "a mixture needs one tokenizer"
    assert f"msar-train: data.mixture[1].path={second}: " in err and want in err, err
    assert "Traceback" not in err
