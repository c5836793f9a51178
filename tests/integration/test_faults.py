"""Faults and bad input found at run time: one line naming the field or file, the documented exit code
(2 bad input, 4 checkpoint write failure), the last good checkpoint safe, the run dir left as it was.

Real training processes (``python -m msar_train.train``, the tiny job of ``test_checkpoint.COMMON``);
a failing disk is injected into ``torch.save`` (the writer DeepSpeed's checkpoint engine calls) by a
wrapper script, and once for real on a tiny tmpfs where this machine lets the test mount one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from msar_train.train import checkpoint as ckpt
from tests.distributed._launch import LAUNCH_LOCAL, REPO, env
from tests.integration.test_checkpoint import COMMON, TIMEOUT_S, cmd, spawn, steps, train, wait_for

SHORT = ["trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2"]
RANK_TRACE = "msar_train/train/"  # a traceback of a rank shows frames of the trainer / CLI files


def run(run_dir: Path, *overrides: str, extra_env: dict | None = None, argv: list[str] | None = None) -> subprocess.CompletedProcess:
    args = argv or cmd(run_dir, *SHORT, *overrides)
    return subprocess.run(args, env=env(**(extra_env or {})), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_one_line(proc: subprocess.CompletedProcess, rc: int, *needles: str) -> None:
    assert proc.returncode == rc, f"rc {proc.returncode} (want {rc}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr[-3000:])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(run_dir, *SHORT)
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- item 1: resume
@pytest.mark.parametrize(
    "overrides,lines",
    [
        (["model.d_model=64"], ["model.d_model: checkpoint 128, this run 64"]),
        (["residual=vanilla"], ["residual.name: checkpoint msar, this run vanilla"]),
        (
            ["residual=msar_m2"],
            ["residual.num_streams: checkpoint 4, this run 2", "residual.kernel_sizes: checkpoint [4, 8, 12], this run [4]"],
        ),
        (["model.moe.n_routed=4"], ["model.moe.n_routed: checkpoint 8, this run 4"]),
    ],
)
def test_resume_with_another_model_is_refused_before_loading(trained, tmp_path, overrides, lines):
    run_dir = copy_run(trained, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (run_dir / "config.yaml", run_dir / "metrics.jsonl")}
    proc = run(run_dir, "trainer.max_steps=6", *overrides)
    assert_one_line(proc, 2, "trained with another model", "nothing was loaded", *lines)
    assert "Error(s) in loading state_dict" not in proc.stderr
    assert {p.name: p.read_bytes() for p in (run_dir / "config.yaml", run_dir / "metrics.jsonl")} == before  # nothing rewritten
    assert not (run_dir / ".lock").exists()


def test_fields_that_may_differ_on_resume():
    from msar_train.train.rundir import model_differences

    saved = {
        "model": {"d_model": 128},
        "residual": {"name": "msar", "kernel": "torch"},
        "trainer": {"lr": 1e-3},
        "parallel": {"pp_stages": 1},
    }
    now = {
        "model": {"d_model": 128},
        "residual": {"name": "msar", "kernel": "triton"},
        "trainer": {"lr": 5e-4},
        "parallel": {"pp_stages": 2},
    }
    assert model_differences(saved, now, "a" * 64, "a" * 64) == []
    assert model_differences(saved, now, "a" * 64, "b" * 64) == [
        f"tokenizer (sha256 of tokenizer.json): checkpoint {'a' * 12}…, this run {'b' * 12}…"
    ]
    now["model"]["extra"] = 1
    assert model_differences(saved, now, None, None) == ["model.extra: checkpoint (absent), this run 1"]


# ------------------------------------------------------------------------ item 2: failed saves
FAILING_SAVE = """
import errno, sys, torch
from msar_train.train.cli import main
real = torch.save
def save(obj, f, *a, **k):
    if {needle!r} in str(f):
        with open(f, "wb") as fh:
            fh.write(b"partial")  # a half-written file, as a full disk leaves it
        raise OSError(errno.{errno}, {message!r}, str(f))
    return real(obj, f, *a, **k)
torch.save = save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "err,message", [("ENOSPC", "No space left on device"), ("EIO", "Input/output error"), ("EACCES", "Permission denied")]
)
def test_a_failed_save_keeps_the_last_checkpoint_and_exits_4(trained, tmp_path, err, message):
    run_dir = tmp_path / "run"
    script = tmp_path / "failing_save.py"
    script.write_text(FAILING_SAVE.format(needle="step00000004", errno=err, message=message))
    proc = run(run_dir, argv=[sys.executable, str(script), *COMMON, *SHORT, f"trainer.run_dir={run_dir}"])
    target = run_dir / "checkpoints" / "step00000004"
    assert_one_line(proc, 4, f"checkpoint of step 4 could not be written to {target}", message, "The last valid checkpoint is step 2")
    assert not target.exists()  # the partial directory is gone: `auto` can never pick it
    root = run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step00000002"
    ckpt.verify(root / "step00000002")
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp files left
    assert not (run_dir / ".lock").exists()
    if err != "ENOSPC":
        return
    # with the disk fixed the same command continues from step 2 to the straight run's losses
    resumed = run(run_dir)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    ref = steps(trained)
    assert [r["train/loss"] for r in steps(run_dir)] == [r["train/loss"] for r in ref]


def test_the_first_failed_save_says_there_is_no_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "failing_save.py"
    script.write_text(FAILING_SAVE.format(needle="step00000002", errno="ENOSPC", message="No space left on device"))
    proc = run(run_dir, argv=[sys.executable, str(script), *COMMON, *SHORT, f"trainer.run_dir={run_dir}"])
    assert_one_line(proc, 4, "step 2 could not be written", "There is no earlier valid checkpoint")
    assert not (run_dir / "checkpoints" / "step00000002").exists()


def test_torch_writer_failure_is_traced_to_the_os_error(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk without an errno; the probe finds it."""
    import errno

    real_open = open

    def full_open(path, mode="r", *a, **k):
        if ".write-probe-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full_open)
    e = ckpt.write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 123 vs 456"), tmp_path)
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert ckpt.write_failure(RuntimeError("a bug"), tmp_path) is None
    monkeypatch.undo()
    assert "unexpected pos" in str(ckpt.write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"), tmp_path))


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True).returncode == 0


def test_a_real_full_disk(trained, tmp_path):
    """The run dir on a tmpfs with room for the run's first checkpoint but not for the second."""
    one = sum(f.stat().st_size for f in (trained / "checkpoints" / "step00000002").rglob("*") if f.is_file())
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, f"{int(one * 1.5) // 4096 * 4096}"):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        run_dir = mnt / "run"
        proc = run(run_dir, "logger.residual_every=0", "logger.heatmap_every=0")
        assert_one_line(proc, 4, "could not be written", "The last valid checkpoint is step 2")
        assert "No space left on device" in proc.stderr or "Errno 28" in proc.stderr, proc.stderr[-2000:]
        assert not (run_dir / "checkpoints" / "step00000004").exists()
        ckpt.verify(run_dir / "checkpoints" / "step00000002")
        assert (run_dir / "checkpoints" / ckpt.LATEST).read_text().strip() == "step00000002"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ------------------------------------------------------------------------- item 3: token ids
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A copy of the prepared default corpus (what the runs here train on), to damage."""
    from msar_train.data.build import ensure_prepared
    from msar_train.data.io import resolve_cache_dir

    src = ensure_prepared("shakespeare", 4096, resolve_cache_dir(None), progress=False)
    dst = tmp_path_factory.mktemp("data") / "shakespeare"
    shutil.copytree(src, dst)
    return dst


def _damage(data: Path, dst: Path, split: str, pos: int, value: int = 65535) -> tuple[Path, int]:
    """Copy of ``data`` with the token at stream position ``pos`` of ``split`` set to ``value``."""
    from msar_train.data.packed import PackedDataset

    shutil.copytree(data, dst)
    shard, offset = PackedDataset(dst, split, verify_checksums=False).locate(pos)
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[offset] = value
    tokens.flush()
    return shard, offset


def test_token_ids_out_of_range_name_shard_offset_and_vocab(data_dir, tmp_path):
    from msar_train.data.loader import PackedLoader
    from msar_train.data.packed import PackedDataset
    from msar_train.errors import InputError

    shard, offset = _damage(data_dir, tmp_path / "bad", "train", 32 * 7 + 5)
    ds = PackedDataset(tmp_path / "bad", "train", verify_checksums=False)
    loader = PackedLoader(ds, seq_len=32, micro_batch_size=2, shuffle=False)
    assert loader.batch_at(0, 1).input_ids_BT.max() < ds.vocab_size  # samples 2, 3: clean
    with pytest.raises(
        InputError, match=rf"token shard {shard}: token id 65535 at token offset {offset} .*vocabulary of size {ds.vocab_size}"
    ):
        loader.batch_at(0, 3)  # samples 6, 7: sample 7 holds the damaged token


def test_a_damaged_shard_read_without_checksums_stops_the_run_naming_it(data_dir, tmp_path):
    bad = tmp_path / "bad"
    shard, _ = _damage(data_dir, bad, "validation", 3)  # the first evaluation batch reads it
    proc = run(tmp_path / "run", f"data.path={bad}", "data.verify_checksums=false")
    assert_one_line(proc, 2, f"token shard {shard}: token id 65535", "outside the vocabulary")
    assert "index out of range" not in proc.stderr


# ------------------------------------------------------------------ item 4: run-time user errors
def _meta_with(data: Path, dst: Path, **changes) -> Path:
    shutil.copytree(data, dst)
    meta = json.loads((dst / "meta.json").read_text())
    for k, v in changes.items():
        node, *path = k.split("__")
        target = meta
        for p in [node, *path][:-1]:
            target = target[int(p)] if isinstance(target, list) else target[p]
        last = [node, *path][-1]
        target[int(last) if isinstance(target, list) else last] = v
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize(
    "case",
    ["missing_dir", "meta_garbage", "meta_types", "truncated", "bitflip", "custom_without_path", "pp2_one_process", "unknown_corpus"],
)
def test_user_errors_at_run_time_are_one_line_and_exit_2(data_dir, tmp_path, case):
    d = tmp_path / "d"
    overrides, needles = [], []
    if case == "missing_dir":
        overrides, needles = [f"data.path={tmp_path / 'nope'}"], [f"data.path={tmp_path / 'nope'} is not a directory"]
    elif case == "meta_garbage":
        shutil.copytree(data_dir, d)
        (d / "meta.json").write_text("{not json")
        overrides, needles = [f"data.path={d}"], [f"{d / 'meta.json'} is not valid JSON"]
    elif case == "meta_types":
        _meta_with(data_dir, d, splits__train__num_tokens="lots")
        overrides, needles = [f"data.path={d}"], [f"{d / 'meta.json'}: splits.train.num_tokens='lots' must be a non-negative integer"]
    elif case in ("truncated", "bitflip"):
        shutil.copytree(data_dir, d)
        shard = d / json.loads((d / "meta.json").read_text())["splits"]["train"]["shards"][0]["file"]
        raw = bytearray(shard.read_bytes())
        if case == "truncated":
            shard.write_bytes(raw[:-2])
            needles = [f"token shard {shard} is truncated"]
        else:
            raw[10] ^= 0x01
            shard.write_bytes(raw)
            needles = [f"token shard {shard} is corrupted"]
        overrides = [f"data.path={d}"]
    elif case == "custom_without_path":
        overrides, needles = ["data.corpus=custom"], ["data.path is required"]
    elif case == "pp2_one_process":
        overrides, needles = ["parallel=pp2"], ["parallel.pp_stages=2: must divide the world size 1"]
    elif case == "unknown_corpus":
        overrides, needles = ["data.corpus=wikitext"], ["data.corpus='wikitext' is not a built-in corpus"]
    proc = run(tmp_path / "run", *overrides)
    assert_one_line(proc, 2, *needles)
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("msar-train:")]) == 1, proc.stderr[-2000:]
    if case == "missing_dir":
        debug = run(tmp_path / "run2", *overrides, extra_env={"MSAR_DEBUG": "1"})
        assert debug.returncode != 0 and "Traceback" in debug.stderr  # MSAR_DEBUG=1 brings the traceback back


@pytest.mark.distributed
def test_the_rank_that_finds_bad_data_reports_it_and_the_others_stay_quiet(data_dir, tmp_path):
    """2 data-parallel ranks; the damaged token sits in a sample only rank 1 reads at step 1."""
    from msar_train.data.loader import PackedLoader
    from msar_train.data.packed import PackedDataset

    seq = 32
    clean = PackedDataset(data_dir, "train", verify_checksums=False)
    rank1 = PackedLoader(clean, seq_len=seq, micro_batch_size=2, seed=0, rank=1, world=2)
    sample = int(rank1.rank_samples(0)[0])
    shard, _ = _damage(data_dir, tmp_path / "bad", "train", sample * seq + 3)
    args = ["bash", str(LAUNCH_LOCAL), "2", *COMMON, *SHORT, "trainer.seed=0", f"data.path={tmp_path / 'bad'}"]
    args += ["data.verify_checksums=false", f"trainer.run_dir={tmp_path / 'run'}", "parallel.dist_timeout_s=60"]
    proc = subprocess.run(args, env=env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert f"msar-train: rank 1: token shard {shard}: token id 65535" in proc.stderr, proc.stderr[-4000:]
    assert RANK_TRACE not in proc.stderr, proc.stderr[-4000:]  # no rank printed a traceback
    assert "msar-train: rank 0: token shard" not in proc.stderr


# --------------------------------------------------------------------- item 5: run-dir hygiene
def _lock(run_dir: Path, host: str, pid: int, age_s: float = 0.0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / ".lock"
    lock.write_text(json.dumps({"host": host, "pid": pid, "started": "then"}))
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_two_jobs_on_one_run_dir_the_second_refuses(tmp_path):
    run_dir = tmp_path / "run"
    first = spawn(run_dir, *SHORT)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), first, "the first job's start")
        first.send_signal(signal.SIGSTOP)  # it holds the run dir while the second one starts
        second = run(run_dir, *SHORT)
        first.send_signal(signal.SIGCONT)
        assert_one_line(second, 2, f"trainer.run_dir={run_dir} is in use by pid {first.pid} on host {socket.gethostname()}")
        out, err = first.communicate(timeout=TIMEOUT_S)
        assert first.returncode == 0, err[-3000:]
    finally:
        first.send_signal(signal.SIGCONT)
        first.kill()
    assert [r["step"] for r in steps(run_dir)] == [1, 2, 3, 4]  # every step once
    assert not (run_dir / ".lock").exists()


def test_stale_locks_are_taken_over_and_live_ones_refused(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    _lock(tmp_path / "a", here, dead.pid)
    proc = run(tmp_path / "a", "trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=2")
    assert proc.returncode == 0 and f"taking over the stale lock {tmp_path / 'a' / '.lock'} of pid {dead.pid}" in proc.stderr, proc.stderr[
        -3000:
    ]
    _lock(tmp_path / "b", "another-node", 12345, age_s=3600)
    proc = run(tmp_path / "b", "trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=2")
    assert proc.returncode == 0 and "no heartbeat for" in proc.stderr, proc.stderr[-3000:]
    lock = _lock(tmp_path / "c", "another-node", 12345)
    assert_one_line(run(tmp_path / "c"), 2, "is in use by pid 12345 on host another-node")
    assert lock.is_file() and not (tmp_path / "c" / "config.yaml").exists()  # nothing else written


def test_a_fresh_start_never_mixes_two_runs(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path / "run")
    old_metrics = (run_dir / "metrics.jsonl").read_bytes()
    proc = run(run_dir, "trainer.resume=none")
    assert_one_line(proc, 2, "trainer.resume=none", "holds checkpoints of an earlier run (newest step00000004)")
    shutil.rmtree(run_dir / "checkpoints")
    proc = run(run_dir, "trainer.resume=none")
    assert proc.returncode == 0 and "is kept as metrics.jsonl.1" in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "metrics.jsonl.1").read_bytes() == old_metrics
    assert [r["step"] for r in steps(run_dir)] == [1, 2, 3, 4]  # the new file: each step once


@pytest.mark.parametrize(
    "script", ["msar-train", "msar-params", "msar-prepare-data", "msar-plan", "msar-eval", "msar-export", "msar-generate"]
)
def test_help_works_for_every_console_script(script):
    import tomllib

    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][script]
    module, func = entry.split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}(['--help']))"
    proc = subprocess.run([sys.executable, "-c", code], env=env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]


def test_every_console_script_is_covered():
    import tomllib

    scripts = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
    covered = {"msar-train", "msar-params", "msar-prepare-data", "msar-plan", "msar-eval", "msar-export", "msar-generate"}
    assert scripts == covered, "add new scripts to the --help test"
