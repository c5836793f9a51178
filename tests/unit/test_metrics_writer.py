"""MetricsWriter: JSONL always, wandb offline under RUN_DIR/wandb/, rank 0 only, resumable run id.

wandb 0.31 writes no ``wandb-summary.json`` in offline mode: what was logged lives in the run's
``run-<id>.wandb`` record log (LevelDB log framing around ``wandb_internal_pb2.Record`` messages),
which ``_wandb_records`` reads; images are copied to ``files/media/images/``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from msar_train.train.metrics import MetricsWriter, git_commit, new_run_id, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _logger(mode: str = "offline") -> SimpleNamespace:
    return SimpleNamespace(mode=mode, project="msar-test", entity=None, group="unit", name="writer", tags=["t1"])


def _png(path: Path) -> Path:
    from msar_train.train.monitor import heatmap_png

    return heatmap_png([[[0.5, float("nan")], [0.25, 0.75]]], path, "test")


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """Keep wandb's own config/cache files inside the test's tmp dir."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def _wandb_records(path: Path):
    """Yield the protobuf Records of an offline ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb record log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # FULL
            payload = chunk
        elif kind == 2:  # FIRST
            pending = chunk
            continue
        elif kind == 3:  # MIDDLE
            pending += chunk
            continue
        elif kind == 4:  # LAST
            payload = pending + chunk
        else:
            continue
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def _finished_records(run_file: Path, timeout_s: float = 30.0) -> list:
    """The run's records once its ``exit`` record is on disk: ``finish()`` can return before
    wandb-core has flushed the offline file (seen with 0.31: a 7-byte file for a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            recs = list(_wandb_records(run_file))
        except Exception:  # a partly written file: retry
            recs = []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def _history_and_run(run_file: Path) -> tuple[dict[int, dict], str, dict]:
    history, run_id, config = {}, None, {}
    for rec in _finished_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(row["_step"], {}).update(row)
        elif kind == "run":
            run_id = rec.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
    return history, run_id, config


def test_jsonl_only_by_default(tmp_path):
    w = MetricsWriter(tmp_path / "run")
    assert w.wandb_run is None and re.fullmatch(r"[a-z0-9]{8}", w.run_id)
    w.log(1, {"train/loss": 2.5, "lr": 1e-3})
    w.log(2, {"train/loss": float("nan"), "val/loss": 2.0})
    w.log_image(2, "residual/depth_attention", "plots/x.png")
    w.close()
    w.close()  # idempotent
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows == [
        {"step": 1, "train/loss": 2.5, "lr": 1e-3},
        {"step": 2, "train/loss": "nan", "val/loss": 2.0},
        {"step": 2, "residual/depth_attention": "plots/x.png"},
    ]
    assert not (tmp_path / "run" / "wandb").exists()


def test_disabled_mode_and_bad_mode(tmp_path):
    w = MetricsWriter(tmp_path, _logger("disabled"))
    assert w.wandb_run is None
    w.close()
    with pytest.raises(ValueError, match="logger.mode='onlin'"):
        MetricsWriter(tmp_path / "b", _logger("onlin"))


def test_nonzero_rank_writes_nothing(tmp_path, wandb_home):
    run_dir = tmp_path / "rank1"
    w = MetricsWriter(run_dir, _logger("offline"), {"a": 1}, run_id="fixedid1", rank=1)
    w.log(1, {"train/loss": 1.0})
    w.log_image(1, "residual/depth_attention", tmp_path / "none.png")
    w.close()
    assert w.run_id == "fixedid1" and w.wandb_run is None
    assert not run_dir.exists()


def test_wandb_offline_keys_image_config_and_resume(tmp_path, wandb_home):
    run_dir = tmp_path / "run"
    png = _png(tmp_path / "heat.png")
    cfg = OmegaConf.create({"model": {"d_model": 16}, "trainer": {"width": "${model.d_model}"}})
    w = MetricsWriter(run_dir, _logger(), cfg)
    run_id = w.run_id
    w.log(1, {"train/loss": 3.0, "moe/layer1/load_entropy": 0.9})
    w.log(2, {"train/loss": 2.0})
    w.log_image(2, "residual/depth_attention", png)
    w.close()

    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    history, rid, config = _history_and_run(runs[0] / f"run-{run_id}.wandb")
    assert rid == run_id
    assert history[1]["train/loss"] == 3.0 and history[1]["moe/layer1/load_entropy"] == 0.9
    assert history[2]["train/loss"] == 2.0
    assert history[2]["residual/depth_attention/_type"] == "image-file"
    media = list((runs[0] / "files" / "media" / "images").rglob("*.png"))
    assert len(media) == 1 and media[0].read_bytes()[:8] == PNG
    assert config["model"] == {"d_model": 16} and config["trainer"] == {"width": 16}  # resolved
    assert config["git_commit"] == git_commit() and config["git_commit"]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1] == {"step": 2, "residual/depth_attention": str(png)}

    # Resume: the same id continues the run (a second offline segment with that id).
    w2 = MetricsWriter(run_dir, _logger(), cfg, run_id=run_id)
    assert w2.run_id == run_id and w2.wandb_run.id == run_id
    w2.log(3, {"train/loss": 1.5})
    w2.close()
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2
    ids_and_steps = [(r[1], sorted(r[0])) for r in (_history_and_run(p / f"run-{run_id}.wandb") for p in runs)]
    assert sorted(ids_and_steps) == [(run_id, [1, 2]), (run_id, [3])]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 2, 3]


def test_run_ids_are_fresh():
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[a-z0-9]{8}", i) for i in ids)
