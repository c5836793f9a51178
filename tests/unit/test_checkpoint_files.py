"""train/checkpoint.py on fake checkpoint folders: manifests, validity, resume resolution, pruning, RNG."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from msar_train.train import checkpoint as ckpt


def make(root, step: int, manifest: bool = True, payload: bytes = b"weights") -> object:
    d = root / ckpt.tag_for(step)
    (d / "sub").mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(payload * 10)
    (d / "sub" / "optim.pt").write_bytes(b"optimizer state")
    if manifest:
        ckpt.write_manifest(d, step, ckpt.file_entries(d, ckpt.payload_files(d)))
    return d


def test_manifest_lists_every_file_and_verifies(tmp_path):
    d = make(tmp_path, 5)
    m = ckpt.verify(d)
    assert m["step"] == 5 and m["tag"] == "step00000005"
    assert sorted(m["files"]) == ["mp_rank_00_model_states.pt", "sub/optim.pt"]
    assert ckpt.step_of(d) == 5 and ckpt.step_of(tmp_path / "other") is None


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: (d / "sub" / "optim.pt").unlink(), "missing file sub/optim.pt"),
        (lambda d: (d / "sub" / "optim.pt").write_bytes(b"short"), "sub/optim.pt has 5 bytes"),
        (lambda d: (d / "sub" / "optim.pt").write_bytes(b"OPTIMIZER STATE"), "sub/optim.pt: sha256 differs"),
        (lambda d: (d / ckpt.MANIFEST).write_text("{not json"), "manifest.json unreadable"),
        (lambda d: (d / ckpt.MANIFEST).unlink(), "incomplete checkpoint"),
    ],
)
def test_damage_is_refused_by_name(tmp_path, damage, message):
    d = make(tmp_path, 3)
    damage(d)
    with pytest.raises(ckpt.CheckpointError, match=message) as err:
        ckpt.verify(d)
    assert str(err.value).startswith(str(d))


def test_a_bit_flip_needs_the_hash(tmp_path):
    d = make(tmp_path, 3)
    (d / "sub" / "optim.pt").write_bytes(b"optimizer stat3")  # same size
    ckpt.verify(d, hash_files=False)
    with pytest.raises(ckpt.CheckpointError, match="sha256"):
        ckpt.verify(d)


def test_auto_takes_the_newest_valid_and_warns_about_the_rest(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 4)
    bad = make(tmp_path, 6)
    (bad / "sub" / "optim.pt").write_bytes(b"x")
    make(tmp_path, 8, manifest=False)  # a save that died
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) == tmp_path / "step00000004"
    assert "step00000008" in warnings[0] and "incomplete" in warnings[0]
    assert "step00000006" in warnings[1] and "corrupted" in warnings[1]
    assert ckpt.resolve_resume("none", tmp_path) is None
    assert ckpt.resolve_resume("auto", tmp_path / "nothing-here") is None  # fresh start


def test_latest_pointer_wins_over_a_newer_directory(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 4)
    ckpt.atomic_write_text(tmp_path / ckpt.LATEST, "step00000002")
    assert ckpt.resolve_resume("auto", tmp_path, warn=lambda m: None) == tmp_path / "step00000002"


def test_auto_refuses_when_only_corrupted_checkpoints_remain(tmp_path):
    bad = make(tmp_path, 3)
    (bad / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="trainer.resume=auto: no valid checkpoint.*step00000003"):
        ckpt.resolve_resume("auto", tmp_path, warn=lambda m: None)


def test_explicit_paths(tmp_path):
    good = make(tmp_path / "checkpoints", 7)
    assert ckpt.resolve_resume(str(good), tmp_path) == good
    assert ckpt.resolve_resume(str(tmp_path / "checkpoints"), tmp_path) == good  # a checkpoints dir
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "x") == good  # a run dir
    (good / "sub" / "optim.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match=f"trainer.resume={good}: {good}: corrupted"):
        ckpt.resolve_resume(str(good), tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="trainer.resume=/no/such: not auto, none"):
        ckpt.resolve_resume("/no/such", tmp_path)


def test_prune_keeps_the_last_k_valid_and_anything_newer(tmp_path):
    for s in (1, 2, 3, 4):
        make(tmp_path, s)
    partial = make(tmp_path, 5, manifest=False)
    gone = ckpt.prune(tmp_path, keep_last=2)
    assert sorted(d.name for d in gone) == ["step00000001", "step00000002"]
    assert [d.name for d in ckpt.checkpoint_dirs(tmp_path)] == ["step00000005", "step00000004", "step00000003"]
    assert partial.exists()  # newer than the kept ones: maybe a save in progress, never deleted here


def test_atomic_write_replaces_whole_files(tmp_path):
    p = tmp_path / "latest"
    ckpt.atomic_write_text(p, "step00000001")
    ckpt.atomic_write_text(p, "step00000002")
    assert p.read_text() == "step00000002" and [f.name for f in tmp_path.iterdir()] == ["latest"]


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == a


def test_load_model_refuses_a_folder_without_checkpoints(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.load_model(tmp_path)
