"""Checkpoint layouts: consolidation of every layout into the single-process model.

Each layout trains the same tiny job (``_layouts.py``: 4 steps, checkpoints at steps 2 and 4, the same 4
samples per step under every layout) through ``_layout_worker.py``, which afterwards lets the layout
evaluate one validation batch and keeps its logits. The runs are made once per session (the
``layout_runs`` fixture of ``conftest.py``) and shared with ``test_relayout.py``.

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
from tests.distributed._layouts import LAYOUTS

pytestmark = pytest.mark.distributed


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


def test_msar_export_of_a_pp_ep_run_gives_the_layouts_logits(layout_runs, tmp_path):
    """msar-export's first step is the consolidation: the HF folder of a PP2 x EP2 run (experts in
    per-rank files, layers in per-stage files) computes the logits the layout computed."""
    import warnings

    from transformers import AutoModelForCausalLM

    from msar_train.export import hf

    run_dir = layout_runs("pp2_ep2")
    out = hf.export(run_dir, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    for f in logits_files(run_dir):
        got = torch.load(f, weights_only=False)
        with torch.no_grad():
            logits = m(got["ids"]).logits
        assert float((logits - got["logits"]).abs().max()) <= 1e-5 * float(got["logits"].abs().max()), f.name


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
