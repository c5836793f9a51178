"""Checkpoint layouts: consolidation of every layout into the single-process model.

Each layout trains the same tiny job (``LAYOUT_COMMON``: 4 steps, checkpoints at steps 2 and 4, the same 4
samples per step under every layout, see ``_launch.py``) through ``_layout_worker.py``, which afterwards
lets the layout evaluate one validation batch and keeps its logits. The runs are made once per session
(``layout_runs``) and shared by every test here.

Consolidation (``train/consolidate.py``): the consolidated single-process ``Transformer`` of the step-4
checkpoint gives the logits the layout itself computed for that batch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from msar_train.train import checkpoint as ckpt
from msar_train.train.consolidate import consolidate
from tests.distributed._launch import run, torchrun_cmd

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_layout_worker.py")
LAYOUT_COMMON = [
    "model=tiny",
    "residual=msar",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "trainer.max_steps=4",
    "trainer.warmup_steps=1",  # the cosine decay runs inside the 4 steps: a wrong schedule on resume shows
    "trainer.save_every=2",
    "trainer.log_every=1",
    "trainer.eval_every=4",
    "trainer.eval_batches=1",
    "trainer.progress=false",
    "logger.mode=disabled",
    "logger.residual_every=0",
    "logger.heatmap_every=0",
]
# name -> (ranks, overrides). Global batch 4 samples per step everywhere (micro 2 x accum x DP).
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["parallel=single", "parallel.grad_accum=2"]),
    "zero2": (2, ["parallel=dp_zero2", "parallel.grad_accum=1"]),
    "pp2": (2, ["parallel=pp2", "parallel.grad_accum=2"]),
    "pp2_v2": (2, ["parallel=pp2", "parallel.virtual_stages=2", "parallel.grad_accum=2"]),
    "ep2": (2, ["parallel=ep2", "parallel.grad_accum=1"]),
    "pp2_ep2": (4, ["parallel=pp2_ep2", "parallel.grad_accum=1"]),
}
TIMEOUT_S = 300


def train_layout(run_dir: Path, nproc: int, *overrides: str) -> Path:
    """Run the worker (``nproc`` ranks; one rank: no launcher) into ``run_dir``."""
    args = [str(run_dir), *LAYOUT_COMMON, *overrides, f"trainer.run_dir={run_dir}"]
    if nproc == 1:
        import sys

        cmd = [sys.executable, str(WORKER), *args]
    else:
        cmd = torchrun_cmd(nproc, WORKER, *args)
    run(cmd, f"layout {overrides}")
    return run_dir


class LayoutRuns:
    def __init__(self, root: Path):
        self.root = root
        self._done: dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self._done:
            nproc, overrides = LAYOUTS[name]
            self._done[name] = train_layout(self.root / name, nproc, *overrides)
        return self._done[name]


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    return LayoutRuns(tmp_path_factory.mktemp("layouts"))


def rows(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/total_loss" in r]


def logits_files(run_dir: Path) -> list[Path]:
    files = sorted(run_dir.glob("logits_rank*.pt"))
    assert files, f"{run_dir}: the layout computed no logits"
    return files


# ----------------------------------------------------------------------------------- consolidation
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_consolidated_model_gives_the_layouts_logits(layout_runs, layout):
    run_dir = layout_runs(layout)
    model, cfg = ckpt.load_model(run_dir)  # newest checkpoint: step 4, the state the layout evaluated with
    for f in logits_files(run_dir):
        got = torch.load(f, weights_only=False)
        assert got["step"] == 4
        with torch.no_grad():
            logits, _ = model(got["ids"])
        diff = float((logits - got["logits"]).abs().max())
        scale = float(got["logits"].abs().max())
        print(f"{layout} {f.name}: max |logit diff| = {diff:.3e} (max |logit| {scale:.3f})")
        assert diff <= 1e-5 * scale, f"{layout} {f.name}: consolidated logits differ by {diff}"


def test_consolidation_is_the_same_model_under_every_layout(layout_runs):
    """The layouts trained the same model on the same samples: their consolidated weights agree to fp32
    rounding (a misplaced expert or layer would differ by O(weights))."""
    ref, _ = consolidate(layout_runs("single"))
    for layout in ("pp2_v2", "pp2_ep2"):
        sd, _ = consolidate(layout_runs(layout))
        assert sd.keys() == ref.keys()
        worst = max(float((sd[k].float() - ref[k].float()).abs().max()) for k in ref)
        assert worst < 1e-4, f"{layout}: weights differ from the single-process run's by {worst}"


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_expert_rank_file_is_named(layout_runs, tmp_path):
    """An expert file of EP rank 1 absent from the directory *and* from the manifest (a checkpoint put
    together by hand): consolidation names the file DeepSpeed would have written."""
    src = layout_runs("pp2_ep2") / "checkpoints" / ckpt.tag_for(4)
    d = _copy_checkpoint(src, tmp_path / ckpt.tag_for(4))
    gone = "layer_2_expert_5_mp_rank_01_model_states.pt"  # stage 1, its third MoE layer, expert 5 (EP rank 1)
    (d / gone).unlink()
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    del manifest["files"][gone]
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=gone):
        consolidate(d)


def test_missing_or_damaged_file_is_named_through_the_manifest(layout_runs, tmp_path):
    src = layout_runs("ep2") / "checkpoints" / ckpt.tag_for(4)
    d = _copy_checkpoint(src, tmp_path / "a" / ckpt.tag_for(4))
    (d / "layer_3_expert_6_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="missing file layer_3_expert_6_mp_rank_00_model_states.pt"):
        consolidate(d)
    d = _copy_checkpoint(src, tmp_path / "b" / ckpt.tag_for(4))
    f = d / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="mp_rank_00_model_states.pt: sha256 differs"):
        consolidate(d)
