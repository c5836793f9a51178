"""Interleaved virtual pipeline stages (``parallel.virtual_stages``) with the cross-stage summary cache.

P = 2 pipeline ranks, V = 2 chunks each, on 2 gloo ranks (tests/distributed/_interleaved_worker.py under
torchrun, one run per mode as module fixtures):
- loss and every gradient equal the single-process ``Transformer`` on the same micro-batches, for attnres
  and msar, with the cache on and off (and msar with document masking: int tensors in the carry);
- the bytes counted at the point-to-point layer equal ``comm_plan``'s cached / naive figures, cached < naive;
- the cache is empty after every step and evaluation, and was used;
- DeepSpeed checkpoint save + resume through ``Engine.save`` / ``Engine.load`` is exact;
- the trainer run (``scripts/launch_local.sh``) reproduces the single-process run's losses and gradient
  norms and logs ``comm/bytes_per_step``.

Tolerances (fp32): loss relative 1e-5; gradients relative 1e-5 as one vector per rank (the norm of the
difference over the norm of the reference), and 1e-4 for the worst single tensor relative to its largest
entry floored at 1e-3 of the rank's largest gradient: MSAR's fusion-gate gradients are 1e4 times smaller
than the rest, sums with heavy cancellation whose fp32 rounding moves with the summation order, which
chunk boundaries change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed._launch import assert_same_training, env, launch_local, run_worker

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_interleaved_worker.py")
CASES = ["msar_cache", "msar_nocache", "attnres_cache", "attnres_nocache", "msar_cache_docmask"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    return run_worker(WORKER, "parity", tmp_path_factory.mktemp("il_parity"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    return run_worker(WORKER, "checkpoint", tmp_path_factory.mktemp("il_ckpt"))


def test_each_rank_hosts_non_contiguous_chunks(parity):
    assert parity[0]["msar_cache"]["chunks"] == [0, 2]
    assert parity[1]["msar_cache"]["chunks"] == [1, 3]


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_single_process(parity, case):
    for rank, res in parity.items():
        r = res[case]
        assert r["loss_rel"] < 1e-5, f"rank {rank} {case}: loss differs by {r['loss_rel']}"
        assert not r["grad_presence_mismatch"], f"rank {rank} {case}: gradient missing on one side {r['grad_presence_mismatch']}"
        assert r["n_grads"] > 50, f"rank {rank} {case}: only {r['n_grads']} gradients compared"
        assert r["grad_global_rel"] < 1e-5, f"rank {rank} {case}: gradients differ by {r['grad_global_rel']}"
        # Per tensor (floored relative error, _interleaved_worker.py): a wrong or missing contribution is O(1).
        assert r["grad_rel"] < 1e-4, f"rank {rank} {case}: {r['grad_rel_worst']} differs by {r['grad_rel']}"


@pytest.mark.parametrize("residual", ["msar", "attnres"])
def test_measured_bytes_equal_the_plan_and_the_cache_saves(parity, residual):
    for rank, res in parity.items():
        on, off = res[f"{residual}_cache"], res[f"{residual}_nocache"]
        assert on["bytes"] == on["step_result_bytes"] == on["plan_cached"], f"rank {rank}: {on}"
        assert off["bytes"] == off["step_result_bytes"] == off["plan_naive"], f"rank {rank}: {off}"
        assert on["bytes"] < off["bytes"]
    docmask = parity[0]["msar_cache_docmask"]
    assert docmask["bytes"] == docmask["plan_cached"] > parity[0]["msar_cache"]["bytes"]  # + doc ids and positions


@pytest.mark.parametrize("case", CASES)
def test_cache_is_used_and_empty_after_every_step(parity, case):
    for rank, res in parity.items():
        r = res[case]
        assert r["cache_after_step"] == r["cache_after_step2"] == r["cache_after_eval"] == 0, f"rank {rank}: {r}"
        if "nocache" in case:
            assert r["cache_peak"] == 0
        else:
            assert r["cache_peak"] > 0, f"rank {rank} {case}: the cache was never used"


def test_checkpoint_save_and_resume(ckpt):
    for rank, r in ckpt.items():
        assert r["client_step"] == 1
        assert r["loss_a"] == r["loss_b"], f"rank {rank}: resumed loss {r['loss_b']} != {r['loss_a']}"
        assert r["param_max_diff"] == 0.0, f"rank {rank}: resumed parameters differ by {r['param_max_diff']}"
    # Layer files are named by global layer index: the checkpoint does not depend on V.
    assert ckpt[0]["layer_files"] == [f"layer_{i:02d}-model_states.pt" for i in range(10)]


def _metrics(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/total_loss" in r]


def test_trainer_run_matches_single_process_and_logs_bytes(tmp_path):
    """Through the CLI with grad_accum=1 < P: the all-forward-then-backward order (the parity runs above
    cover interleaved 1F1B with grad_accum=2)."""
    from msar_train.config import compose_config
    from msar_train.parallel.comm import comm_plan

    common = ["model=tiny", "residual=msar", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=3"]
    common += ["trainer.progress=false", "data.seq_len=32", "parallel.micro_batch_size=2", "parallel.grad_accum=1"]
    common += ["logger.mode=disabled", "trainer.save_every=0"]
    pipe = ["parallel=pp2", "parallel.virtual_stages=2"]
    single = subprocess.run(
        [str(Path(sys.executable).with_name("msar-train")), *common, f"trainer.run_dir={tmp_path / 'single'}"],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    launch = subprocess.run(
        [str(REPO / "scripts" / "launch_local.sh"), "2", *common, *pipe, f"trainer.run_dir={tmp_path / 'pipe'}"],
        env=env(PYTHON=sys.executable),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert launch.returncode == 0, launch.stderr[-4000:]
    a, b = _metrics(tmp_path / "single"), _metrics(tmp_path / "pipe")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert abs(ra["train/total_loss"] - rb["train/total_loss"]) <= 1e-5 * abs(ra["train/total_loss"])
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]
    plan = comm_plan(compose_config([*common, *pipe]))
    assert [r["comm/bytes_per_step"] for r in b] == [plan["comm_bytes_cached"]] * 3


def test_expert_parallel_with_virtual_stages_matches_single_process(runs, tmp_path):
    """4 ranks: P=2 x V=2 chunks, each stage's experts sharded over its 2 data-parallel ranks (ZeRO-1).
    DP=2 x micro 2 x grad_accum 1 sees the single-process run's samples per step (``_launch.py``)."""
    layout = ["parallel=pp2_ep2", "parallel.virtual_stages=2", "parallel.grad_accum=1"]
    rows = launch_local(4, tmp_path / "pp2_ep2_v2", "residual=msar", *layout)
    assert_same_training(rows, runs.single("msar"))
    assert all(r["comm/bytes_per_step"] > 0 for r in rows)
