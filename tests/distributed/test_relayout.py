"""Resume under another layout (``train/reshard.py``).

Each layout of ``_layouts.LAYOUTS`` trained the same 4-step job on the same 4 samples per step, with
checkpoints at steps 2 and 4. Here the step-2 checkpoint of layout A is resumed under layout B for
steps 3 and 4: B's losses and gradient norms must equal A's own steps 3 and 4 within 1e-5 relative
(fp32 on CPU; only the reduction order differs), which needs the weights, both AdamW moments, the step
count, the LR schedule, the router biases and the data position all carried over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from msar_train.train import checkpoint as ckpt
from msar_train.train.reshard import read_state
from tests.distributed._launch import run, torchrun_cmd
from tests.distributed._layouts import LAYOUT_COMMON, LAYOUTS, WORKER, rows

pytestmark = pytest.mark.distributed

# Targets that are not also sources: PP4 (one rank per stage, DP 1).
TARGETS = {**LAYOUTS, "pp4": (4, ["parallel=pp2", "parallel.pp_stages=4", "parallel.grad_accum=2"])}
# (source, target): every source layout once, every target layout once, and the PP2xEP2 -> PP4 / single.
PAIRS = [
    ("pp2_ep2", "pp4"),
    ("single", "pp2_ep2"),
    ("pp2_ep2_z0", "zero2"),
    pytest.param("pp2_ep2", "single", marks=pytest.mark.slow),  # slow: the default suite's time ceiling
    pytest.param("zero2", "pp2_v2", marks=pytest.mark.slow),
    pytest.param("ep2", "pp2", marks=pytest.mark.slow),
    pytest.param("pp2", "ep2", marks=pytest.mark.slow),
    pytest.param("pp2_v2", "single", marks=pytest.mark.slow),
]
RTOL = 1e-5
# Data-parallel degree: each DP rank evaluates its own validation batches, so val/loss compares only
# between layouts of the same degree.
DP = {"single": 1, "zero2": 2, "pp2": 1, "pp2_v2": 1, "ep2": 2, "pp2_ep2": 2, "pp2_ep2_z0": 2, "pp4": 1}


def resume_under(src_run: Path, out: Path, target: str, *extra: str):
    """A new run dir holding only ``src_run``'s step-2 checkpoint, continued to step 4 under ``target``."""
    (out / "checkpoints").mkdir(parents=True)
    tag = ckpt.tag_for(2)
    shutil.copytree(src_run / "checkpoints" / tag, out / "checkpoints" / tag)
    (out / "checkpoints" / ckpt.LATEST).write_text(tag)
    nproc, overrides = TARGETS[target]
    args = [str(out), *LAYOUT_COMMON, *overrides, *extra, f"trainer.run_dir={out}"]
    import sys

    cmd = [sys.executable, str(WORKER), *args] if nproc == 1 else torchrun_cmd(nproc, WORKER, *args)
    return run(cmd, f"resume of {src_run.name} under {target}")


def _val(run_dir: Path) -> float:
    vals = [r["val/loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "val/loss" in r]
    assert vals, f"{run_dir}: no val/loss"
    return vals[-1]


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_resume_under_another_layout_continues_the_run(layout_runs, tmp_path, source, target):
    src = layout_runs(source)
    proc = resume_under(src, tmp_path / "b", target)
    assert "was written under another layout" in proc.stdout and "resharded" in proc.stdout, proc.stdout[-2000:]
    a = {r["step"]: r for r in rows(src)}
    b = {r["step"]: r for r in rows(tmp_path / "b")}
    assert sorted(b) == [3, 4], f"the resumed run logged steps {sorted(b)}"
    for step in (3, 4):
        for key in ("train/total_loss", "grad_norm", "lr"):
            want, got = a[step][key], b[step][key]
            print(f"{source} -> {target} step {step} {key}: {want!r} vs {got!r}")
            assert abs(got - want) <= RTOL * abs(want), f"{source} -> {target}: step {step} {key} {got} != {want}"
    if DP[source] == DP[target]:
        assert abs(_val(tmp_path / "b") - _val(src)) <= RTOL * _val(src)


def test_logical_state_is_the_same_under_every_layout(layout_runs):
    """The per-parameter view of every layout's step-2 checkpoint: the same names, fp32 masters that are
    the module's own weights, and moments that agree with the single-process run's to fp32 rounding (a
    misplaced fragment, expert or replica would differ by O(1))."""
    ref = read_state(layout_runs("single") / "checkpoints" / ckpt.tag_for(2))
    assert ref.moments and set(ref.step.values()) == {2.0}
    for layout in LAYOUTS:
        st = read_state(layout_runs(layout) / "checkpoints" / ckpt.tag_for(2))
        assert st.moments.keys() == ref.moments.keys(), layout
        assert set(st.step.values()) == {2.0}, layout
        for name, master in st.master.items():
            assert torch.equal(master, st.module[name].float()), f"{layout}: fp32 master of {name} is not the module's weight"
        for k in ("exp_avg", "exp_avg_sq"):
            worst = max(
                float((st.moments[n][k] - ref.moments[n][k]).abs().max() / ref.moments[n][k].abs().max().clamp_min(1e-30))
                for n in ref.moments
            )
            assert worst < 1e-3, f"{layout}: {k} differs from the single-process run's by {worst} (relative to its max)"
        assert st.scheduler["last_epoch"] == ref.scheduler["last_epoch"] == 2
        assert st.client["step"] == 2


def test_old_plain_checkpoint_without_parameter_names_is_refused_by_name(layout_runs, tmp_path):
    """A non-ZeRO checkpoint from before ``param_names`` existed names the way out instead of guessing."""
    src = layout_runs("single") / "checkpoints" / ckpt.tag_for(2)
    d = tmp_path / ckpt.tag_for(2)
    shutil.copytree(src, d)
    f = d / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=False)
    del state[ckpt.CLIENT_KEY]["param_names"]
    torch.save(state, f)
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    manifest["files"].update(ckpt.file_entries(d, [f.name]))  # a consistent checkpoint, only older
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="has no recorded parameter names"):
        read_state(d)


def test_same_layout_other_micro_batch_continues(layout_runs, tmp_path):
    """Only the micro-batch split changes (same world, ZeRO and pipeline): DeepSpeed's own loader, and
    the data position carried over to micro 4 x accum 1 (the same 4 samples per step)."""
    src = layout_runs("single")
    proc = resume_under(src, tmp_path / "b", "single", "parallel.micro_batch_size=4", "parallel.grad_accum=1")
    assert "resharded" not in proc.stdout
    a = {r["step"]: r for r in rows(src)}
    b = {r["step"]: r for r in rows(tmp_path / "b")}
    for step in (3, 4):
        assert abs(b[step]["train/total_loss"] - a[step]["train/total_loss"]) <= RTOL * a[step]["train/total_loss"]


def test_data_position_that_cannot_continue_is_refused(layout_runs, tmp_path):
    """8 samples consumed by step 2; micro-batches of 3 on one rank cannot continue after them."""
    import subprocess
    import sys

    from tests.distributed._launch import env

    src = layout_runs("pp2_ep2")
    out = tmp_path / "b"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / ckpt.tag_for(2), out / "checkpoints" / ckpt.tag_for(2))
    args = [*LAYOUT_COMMON, "parallel=single", "parallel.micro_batch_size=3", "parallel.grad_accum=1", f"trainer.run_dir={out}"]
    proc = subprocess.run(
        [sys.executable, "-m", "msar_train.train", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "parallel.micro_batch_size=3" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
