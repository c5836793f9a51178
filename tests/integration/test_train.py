"""End-to-end training through the CLI on the built-in Shakespeare corpus (prepared once, cached)."""

import json

import pytest

from msar_train.train.cli import main
from msar_train.train.metrics import read_metrics
from tests.unit.helpers import RESIDUAL_PRESETS

FAST = ["model=tiny", "data.seq_len=64", "parallel.micro_batch_size=4", "trainer.log_every=1", "trainer.progress=false"]


def run(tmp_path, name, *extra):
    rd = tmp_path / name
    assert main([*FAST, f"trainer.run_dir={rd}", *extra]) == 0
    return read_metrics(rd / "metrics.jsonl")


MAIN = ("vanilla", "mhc", "attnres", "msar")  # the ablation presets: slow (the default suite's time ceiling)


@pytest.mark.parametrize("residual", [p if p in MAIN else pytest.param(p, marks=pytest.mark.slow) for p in RESIDUAL_PRESETS])
def test_50_steps_lower_the_loss(tmp_path, residual):
    rows = run(tmp_path, residual, f"residual={residual}", "trainer.max_steps=50", "trainer.eval_every=50", "trainer.warmup_steps=5")
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 50 and [r["step"] for r in rows] == list(range(1, 51))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert "val/loss" in rows[-1] and rows[-1]["val/loss"] < losses[0]


def test_training_is_deterministic_under_a_seed(tmp_path):
    a = run(tmp_path, "a", "trainer.max_steps=6", "trainer.eval_every=3")
    b = run(tmp_path, "b", "trainer.max_steps=6", "trainer.eval_every=3")
    assert [r["train/loss"] for r in a] == [r["train/loss"] for r in b]
    assert [r.get("val/loss") for r in a] == [r.get("val/loss") for r in b]


def test_gradient_accumulation_matches_a_larger_batch(tmp_path):
    common = ["residual=vanilla", "model.moe.seq_aux_loss_coef=0", "trainer.max_steps=3", "trainer.eval_every=100"]
    big = run(tmp_path, "big", *common, "parallel.micro_batch_size=8")
    acc = run(tmp_path, "acc", *common, "parallel.micro_batch_size=4", "parallel.grad_accum=2")
    for x, y in zip(big, acc):
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-4)


def test_run_dir_has_config_and_jsonl(tmp_path, capsys):
    rows = run(tmp_path, "r", "trainer.max_steps=2", "trainer.eval_every=2")
    out = capsys.readouterr().out
    assert "train/loss=" in out and "val/loss=" in out and str(tmp_path / "r") in out
    assert (tmp_path / "r" / "config.yaml").is_file()
    assert all("step" in r and "train/loss" in r for r in rows)
    json.dumps(rows)


def test_bad_override_exits_2_naming_the_field(tmp_path, capsys):
    assert main([*FAST, "trainer.schedule=bogus", f"trainer.run_dir={tmp_path}/x"]) == 2
    assert "trainer.schedule" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
