"""Hydra multiruns (``msar-train -m``), run records and the study report, with real (tiny) runs.

The study itself runs outside CI (README "Reproducing the paper's comparisons"); this is its smoke
test: a two-job sweep of a few steps, skipping of finished jobs, an interrupted job resumed by the next
sweep to the same losses, a failing job recorded while the sweep goes on, and the report built from
the two real records.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from msar_train.config import compose_config
from msar_train.train.records import NOT_IN_NAME, load_records, read_record, variant_of
from tests.distributed._launch import env as launch_env

ROOT = Path(__file__).resolve().parents[2]
# The smoke protocol: a few cheap steps of a smaller tiny model, an eval at every second step, as an
# experiment config in a copy of configs/ (the way a study fixes its protocol).
SMOKE = """# @package _global_
defaults:
  - study_protocol
  - _self_
experiment:
  name: smoke
model: {n_layers: 4, d_model: 64, n_heads: 2, n_kv_heads: 1}
data: {seq_len: 32}
parallel: {micro_batch_size: 2}
trainer: {max_steps: 4, eval_every: 2, eval_batches: 2, warmup_steps: 1, save_every: 2}
"""


def sweep(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    configs = tmp / "configs"
    if not configs.is_dir():
        shutil.copytree(ROOT / "configs", configs)
        (configs / "experiment" / "smoke.yaml").write_text(SMOKE)
    # launch_env drops the rank variables an earlier in-process test left in os.environ: inherited,
    # they would make the sweep reuse that test's MASTER_PORT (EADDRINUSE).
    env = launch_env(MSAR_CONFIG_DIR=str(configs))
    cmd = [sys.executable, "-m", "msar_train.train", "-m", "experiment=smoke", *overrides, f"hydra.sweep.dir={tmp / 'sweep'}",
           f"experiment.records_dir={tmp / 'records'}"]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def job_dirs(tmp: Path) -> list[Path]:
    return sorted(p for p in (tmp / "sweep").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    res = sweep(tmp, "residual=vanilla,attnres", "trainer.seed=1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp, res


def test_multirun_one_run_dir_and_record_per_job(two_jobs):
    tmp, res = two_jobs
    dirs = job_dirs(tmp)
    # named from the job's overrides; execution-only fields (logger.mode, trainer.progress) left out
    assert [d.name for d in dirs] == ["residual=attnres,trainer.seed=1", "residual=vanilla,trainer.seed=1"]
    for d in dirs:
        rec = read_record(d / "record.json")
        assert rec == read_record(tmp / "records" / f"{d.name}.json")  # the records-dir copy
        assert rec["status"] == "finished" and rec["steps"] == 4 and rec["seed"] == 1
        assert rec["variant"] == f"residual={rec['choices']['residual']}" == variant_of(rec["overrides"])
        assert [row[0] for row in rec["val_curve"]] == [2, 4]  # every evaluation, whatever log_every says
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert rec["final"]["val_loss"] == [r["val/loss"] for r in rows if "val/loss" in r][-1]
        assert (
            rec["experiment"] == "smoke"
            and rec["tokens"] == 4 * 2 * 32
            and rec["flops"] == pytest.approx(rec["tokens"] * rec["flops_per_token"])
        )
        assert rec["config"]["trainer"]["run_dir"] == str(d) and rec["wall_time_s"] > 0 and rec["git_commit"]


def test_finished_jobs_are_skipped(two_jobs):
    tmp, _ = two_jobs
    before = {d: (d / "metrics.jsonl").stat().st_mtime_ns for d in job_dirs(tmp)}
    res = sweep(tmp, "residual=vanilla,attnres", "trainer.seed=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("exists, skipping") == 2
    assert {d: (d / "metrics.jsonl").stat().st_mtime_ns for d in job_dirs(tmp)} == before


def test_a_record_in_records_dir_alone_skips_the_job(two_jobs, tmp_path):
    """A fresh clone has the committed records but no sweep dirs: nothing reruns."""
    tmp, _ = two_jobs
    (tmp_path / "records").mkdir()
    for f in (tmp / "records").glob("*.json"):
        (tmp_path / "records" / f.name).write_text(f.read_text())
    res = sweep(tmp_path, "residual=vanilla,attnres", "trainer.seed=1")
    assert res.returncode == 0 and res.stdout.count("exists, skipping") == 2
    assert sorted(d.name for d in job_dirs(tmp_path)) == sorted(d.name for d in job_dirs(tmp))
    assert all((d / "record.json").is_file() and not (d / "metrics.jsonl").exists() for d in job_dirs(tmp_path))


def test_interrupted_job_resumes_to_the_same_losses(two_jobs, tmp_path):
    """stop_at ends the job after step 2 (as a kill would, minus the lost steps): no record; the next
    sweep resumes it (trainer.resume=auto) and its curve equals the uninterrupted run's bit for bit."""
    tmp, _ = two_jobs
    first = sweep(tmp_path, "residual=attnres", "trainer.seed=1", "trainer.stop_at=2")
    assert first.returncode == 0 and "no record yet" in first.stdout, first.stdout[-2000:] + first.stderr[-2000:]
    assert not list((tmp_path / "records").glob("*.json")) if (tmp_path / "records").exists() else True
    # the resumed sweep has no stop_at override, hence another job name: point it at the same run dir
    (stopped,) = job_dirs(tmp_path)
    assert stopped.name == "residual=attnres,trainer.seed=1,trainer.stop_at=2"
    target = stopped.parent / "residual=attnres,trainer.seed=1"
    stopped.rename(target)
    second = sweep(tmp_path, "residual=attnres", "trainer.seed=1")
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stdout[-2000:] + second.stderr[-2000:]
    rec = read_record(target / "record.json")
    (ref,) = [read_record(d / "record.json") for d in job_dirs(tmp) if "residual=attnres" in d.name]
    assert rec["val_curve"] == ref["val_curve"] and rec["train_curve"] == ref["train_curve"]


def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    """Job 1 halts (every step non-finite, 2 allowed in a row); job 2 still runs; exit status 1."""
    res = sweep(tmp_path, "trainer.debug_nan_steps=[1,2,3,4]", "trainer.max_consecutive_skips=2", "residual=vanilla", "trainer.seed=1,2")
    assert res.returncode == 1, res.stdout[-2000:]
    recs = {r["seed"]: r for r in load_records([tmp_path / "records"])}
    assert set(recs) == {1, 2} and all(r["status"] == "failed" and "TrainingHalted" in r["error"] for r in recs.values())
    again = sweep(tmp_path, "trainer.debug_nan_steps=[1,2,3,4]", "trainer.max_consecutive_skips=2", "residual=vanilla", "trainer.seed=1,2")
    assert again.stdout.count("exists, skipping") == 2  # deterministic failures are not retried silently


def test_report_from_the_two_real_records(two_jobs, tmp_path, monkeypatch):
    tmp, _ = two_jobs
    spec = importlib.util.spec_from_file_location("study_report", ROOT / "scripts" / "study_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "docs" / "results.md"
    # a study of three jobs, two of them the records': its progress row and the estimate of the third
    study = "# @package _global_\ndefaults:\n  - smoke\n  - _self_\n"
    study += "hydra:\n  sweeper:\n    params:\n      residual: vanilla,attnres,msar\n      trainer.seed: 1\n"
    (tmp_path / "exp").mkdir()
    for d in (tmp_path / "exp", tmp / "configs" / "experiment"):
        (d / "study_three.yaml").write_text(study)
    monkeypatch.setenv("MSAR_CONFIG_DIR", str(tmp / "configs"))
    assert mod.main([str(tmp / "records"), "--out", str(out), "--bootstrap", "20", "--experiments", str(tmp_path / "exp")]) == 0
    text = out.read_text()
    recs = load_records([tmp / "records"])
    assert len(recs) == 2 and "from 2 run records (0 failed)" in text
    for r in recs:  # each variant's final loss appears in its table row
        assert f"| {r['choices']['residual']} | 1 | {r['final']['val_loss']:.4f} +- n/a |" in text
    assert (tmp_path / "docs" / "images" / "study_backends.png").stat().st_size > 1000
    assert "![Validation loss against training FLOPs, backends](images/study_backends.png)" in text
    row = next(line for line in text.splitlines() if line.startswith("| study_three |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["3", "2"] and cells[4] == "1" and float(cells[5]) > 0
    assert float(cells[3]) == pytest.approx(sum(r["wall_time_s"] for r in recs) / 3600, abs=0.006)


def test_job_names_and_variants_leave_out_the_same_fields():
    """configs/train.yaml's override_dirname exclusions and the records' NOT_IN_NAME are one list."""
    hydra = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["hydra"]
    assert tuple(hydra["job"]["config"]["override_dirname"]["exclude_keys"]) == NOT_IN_NAME
    assert (
        variant_of(["residual=msar", "trainer.seed=3", "data=ptb", "trainer.threads=1", "model=scale_s"]) == "residual=msar,model=scale_s"
    )


@pytest.mark.parametrize("study", ["study_seeds", "study_backends", "study_ablation", "study_scaling"])
def test_study_configs_compose_and_share_one_protocol(study):
    """Each study is the shared protocol plus its sweep; its config composes for every swept value."""
    text = yaml.safe_load((ROOT / "configs" / "experiment" / f"{study}.yaml").read_text())
    params = text["hydra"]["sweeper"]["params"]
    base = compose_config(["experiment=study_protocol"])
    for key, values in params.items():
        for v in str(values).split(","):
            cfg = compose_config([f"experiment={study}", f"{key}={v}"])
            assert cfg.trainer.max_steps == base.trainer.max_steps and cfg.experiment.records_dir == "results/study"
            assert cfg.trainer.eval_batches == base.trainer.eval_batches and cfg.data.seq_len == base.data.seq_len


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None, reason="pip install -e '.[slurm]'")
def test_submitit_launcher_runs_the_same_jobs(two_jobs, tmp_path):
    """hydra/launcher=submitit_local: what submitit_slurm does on a cluster (pickled task, one process
    per job), on this machine. Same job names, same losses as the basic launcher's."""
    tmp, _ = two_jobs
    res = sweep(tmp_path, "residual=vanilla,attnres", "trainer.seed=1", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for d in job_dirs(tmp):
        mine = read_record(tmp_path / "records" / f"{d.name}.json")
        assert mine["val_curve"] == read_record(d / "record.json")["val_curve"]


def test_sigterm_ends_the_sweep_with_a_checkpoint(tmp_path):
    """SIGTERM during job 1: it saves and the sweep ends (143) before job 2; the next sweep resumes job 1."""
    import signal
    import time

    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", configs)
    (configs / "experiment" / "smoke.yaml").write_text(
        SMOKE.replace("max_steps: 4", "max_steps: 400").replace("save_every: 2", "save_every: 1000")
    )
    # launch_env drops the rank variables an earlier in-process test left in os.environ: inherited,
    # they would make the sweep reuse that test's MASTER_PORT (EADDRINUSE).
    env = launch_env(MSAR_CONFIG_DIR=str(configs))
    cmd = [sys.executable, "-m", "msar_train.train", "-m", "experiment=smoke", "residual=vanilla", "trainer.seed=1,2",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", f"experiment.records_dir={tmp_path / 'records'}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "sweep" / "residual=vanilla,trainer.seed=1" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "sweep stopped by SIGTERM" in out and not (tmp_path / "sweep" / "residual=vanilla,trainer.seed=2").exists()
    assert list((tmp_path / "sweep" / "residual=vanilla,trainer.seed=1" / "checkpoints").glob("step*/manifest.json"))
    assert not (tmp_path / "records").exists() or not list((tmp_path / "records").iterdir())
