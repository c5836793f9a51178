"""Checkpoints, exact resume and fault handling with real training processes and real signals.

Every run is the same tiny msar job (``COMMON``) in its own process (``python -m msar_train.train``).
The reference is one straight 8-step run; everything else (a time-sliced run, SIGTERM / SIGINT, kill -9,
a corrupted newest checkpoint) must reproduce its per-step losses and gradient norms bit for bit.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from msar_train.train import checkpoint as ckpt
from msar_train.train.metrics import read_metrics
from tests.distributed._launch import LAUNCH_LOCAL, REPO, env
from tests.unit.test_metrics_writer import _history_and_run

COMMON = [
    "model=tiny",
    "residual=msar",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "trainer.max_steps=8",
    "trainer.warmup_steps=2",  # the cosine decay is inside the 8 steps: a wrong schedule on resume shows
    "trainer.log_every=1",
    "trainer.eval_every=4",
    "trainer.eval_batches=1",
    "trainer.save_every=4",
    "trainer.progress=false",
    "logger.mode=disabled",
    "logger.residual_every=4",
    "logger.heatmap_every=4",
]
KEYS = ("train/total_loss", "train/loss", "grad_norm", "lr")
TIMEOUT_S = 300


def cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "msar_train.train", *COMMON, *overrides, f"trainer.run_dir={run_dir}"]


def train(run_dir: Path, *overrides: str, rc: int = 0, **extra_env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd(run_dir, *overrides), env=env(**extra_env), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == rc, f"rc {proc.returncode} (want {rc}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/total_loss" in r]


def assert_bitwise_same(rows: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for a, b in zip(rows, ref, strict=True):
        for k in (*KEYS, "val/loss"):
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))


def spawn(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(cmd(run_dir, *overrides), env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(pred, proc: subprocess.Popen, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train(run_dir)
    return run_dir


def test_straight_run_saves_every_4_steps_with_verified_manifests(straight):
    root = straight / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step00000008"
    assert [d.name for d in ckpt.checkpoint_dirs(root)] == ["step00000008", "step00000004"]
    for d in ckpt.checkpoint_dirs(root):
        manifest = ckpt.verify(d)
        assert manifest["step"] == ckpt.step_of(d) and manifest["files"]
    rows = steps(straight)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[3]["lr"] != rows[7]["lr"]


def test_stop_at_and_resume_equals_the_straight_run_and_continues_the_wandb_run(straight, tmp_path):
    run_dir = tmp_path / "sliced"
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-home")}
    first = train(run_dir, "trainer.stop_at=4", "logger.mode=offline", **wandb_env)
    assert "resumed from" not in first.stdout
    assert [r["step"] for r in steps(run_dir)] == [1, 2, 3, 4]
    second = train(run_dir, "trainer.resume=auto", "logger.mode=offline", **wandb_env)
    assert "resumed from" in second.stdout and "step00000004" in second.stdout
    assert_bitwise_same(steps(run_dir), steps(straight))

    # wandb offline: both jobs logged into one run id; the keys and the heatmap image are there.
    run_files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2, run_files
    (h1, id1, config), (h2, id2, _) = (_history_and_run(f) for f in run_files)
    assert id1 == id2 and len(id1) == 8
    assert config["git_commit"] and config["residual"]["name"] == "msar"
    assert sorted(h1) == [1, 2, 3, 4] and sorted(h2) == [5, 6, 7, 8]
    logged = set().union(*h1.values(), *h2.values())
    for key in (*KEYS, "val/loss", "tokens_per_s", "step_time_s", "train/skipped_steps", "moe/worst/load_max_over_mean"):
        assert key in logged, key
    assert any(k.startswith("moe/layer") and k.endswith("/router_bias_norm") for k in logged)
    assert any(k.startswith("residual/depth_entropy/") for k in logged)
    assert any(k.startswith("residual/fusion_weight/") for k in logged)
    assert h1[4]["residual/depth_attention/_type"] == "image-file"  # nested image record
    images = sorted((run_dir / "wandb").glob("offline-run-*/files/media/images/residual/depth_attention_*.png"))
    assert len(images) == 2 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in images)
    # JSONL: the image path sits in the step's own row, next to its loss
    row4 = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == 4)
    assert Path(row4["residual/depth_attention"]).is_file() and "train/loss" in row4


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits_0(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = spawn(run_dir, "trainer.max_steps=100000", "trainer.save_every=0", "trainer.eval_every=100000")
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(steps(run_dir)) >= 2, proc, "two logged steps")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    last = steps(run_dir)[-1]["step"]
    assert f"stopped by {sig.name} after step {last}" in out
    root = run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == ckpt.tag_for(last)
    ckpt.verify(root / ckpt.tag_for(last))


def test_kill_9_then_resume_auto_continues_from_the_last_checkpoint(straight, tmp_path):
    run_dir = tmp_path / "run"
    proc = spawn(run_dir)
    wait_for(lambda: (run_dir / "checkpoints" / "step00000004" / ckpt.MANIFEST).is_file(), proc, "the step-4 checkpoint")
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = train(run_dir, "trainer.resume=auto")
    assert "resumed from" in resumed.stdout
    assert_bitwise_same(steps(run_dir), steps(straight))


def test_corrupted_checkpoint_is_named_and_auto_falls_back(straight, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    (run_dir / "metrics.jsonl").write_text("")  # this copy re-logs what it re-runs
    bad = run_dir / "checkpoints" / "step00000008"
    model_file = bad / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:-100])  # truncated

    with pytest.raises(ckpt.CheckpointError, match="step00000008"):
        ckpt.verify(bad)
    explicit = train(run_dir, f"trainer.resume={bad}", rc=2)
    assert str(bad) in explicit.stderr and "mp_rank_00_model_states.pt" in explicit.stderr

    fallback = train(run_dir, "trainer.resume=auto")
    assert "step00000008" in fallback.stderr  # the warning names the refused checkpoint
    assert "resumed from" in fallback.stdout and "step00000004" in fallback.stdout
    assert_bitwise_same(steps(run_dir), [r for r in steps(straight) if r["step"] > 4])
    ckpt.verify(bad)  # re-written by the fallback run's final save


def test_nan_steps_are_skipped_counted_and_k_in_a_row_halt(tmp_path):
    ok = train(tmp_path / "one", "trainer.max_steps=4", "trainer.debug_nan_steps=[2]")
    rows = steps(tmp_path / "one")
    assert rows[1]["train/loss"] == "nan" and rows[1]["train/skipped_steps"] == 1
    assert rows[3]["train/skipped_steps"] == 1 and all(isinstance(r["train/loss"], float) for r in rows[2:])
    assert "final step=4" in ok.stdout

    halted = train(tmp_path / "halt", "trainer.debug_nan_steps=[2,3,4]", "trainer.max_consecutive_skips=3", rc=3)
    assert "trainer.max_consecutive_skips=3" in halted.stderr and "steps 2..4" in halted.stderr
    assert [r["step"] for r in steps(tmp_path / "halt")] == [1, 2, 3, 4]


def test_skipped_step_updates_nothing(tmp_path):
    """In process: a poisoned step leaves weights, optimizer state, LR schedule and router biases alone."""
    import torch

    from msar_train.config import compose_config
    from msar_train.train.trainer import Trainer

    cfg = compose_config([*COMMON, f"trainer.run_dir={tmp_path}", "trainer.debug_nan_steps=[2]", "trainer.resume=none"])
    tr = Trainer(cfg)
    tr.train_step()
    module = tr.engine.engine.module
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    sched = tr.engine.scheduler.state_dict()["last_epoch"]
    exp_avg = {id(p): s["exp_avg"].clone() for p, s in tr.engine.optimizer.state.items()}
    m = tr.train_step()
    assert m["train/skipped_steps"] == 1 and tr.consecutive_skips == 1
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    assert tr.engine.scheduler.state_dict()["last_epoch"] == sched
    assert all(torch.equal(exp_avg[id(p)], s["exp_avg"]) for p, s in tr.engine.optimizer.state.items())
    m = tr.train_step()
    assert tr.consecutive_skips == 0 and m["train/skipped_steps"] == 1
    assert any(not torch.equal(before[k], module.state_dict()[k]) for k in before)


def test_plot_depth_attention_from_a_training_checkpoint(straight, tmp_path):
    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_depth_attention.py"), str(straight), "--out", str(out), "--batches", "2"],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = out / "depth_attention.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in proc.stdout


@pytest.mark.distributed
def test_resume_with_two_pipeline_stages_is_exact(tmp_path):
    pp = ["parallel=pp2", "parallel.grad_accum=2", "trainer.max_steps=4", "trainer.save_every=2"]

    def launch(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
        args = ["bash", str(LAUNCH_LOCAL), "2", *COMMON, *pp, *extra, f"trainer.run_dir={run_dir}"]
        proc = subprocess.run(args, env=env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return proc

    launch(tmp_path / "straight")
    launch(tmp_path / "sliced", "trainer.stop_at=2")
    resumed = launch(tmp_path / "sliced", "trainer.resume=auto")
    assert "resumed from" in resumed.stdout
    ref = steps(tmp_path / "straight")
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    assert_bitwise_same(steps(tmp_path / "sliced"), ref)
    files = json.loads(json.dumps(ckpt.verify(tmp_path / "sliced" / "checkpoints" / "step00000004")["files"]))
    assert any(name.startswith("layer_") for name in files)  # pipeline layer files are in the manifest
